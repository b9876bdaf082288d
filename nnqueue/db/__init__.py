"""Job state: the schema (models), the status machine (lifecycle) and database sessions."""
