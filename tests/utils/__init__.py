"""Helpers the tests share: throwaway servers, the tiny model, payloads as clients build them, one module's
service namespace with its worker processes, and the API test client. Fixtures live in the conftest files."""
