"""A tiny random Llama checkpoint, built locally and deterministically for engine tests.

No network: the weights are seeded random, and the tokenizer is a byte-level BPE trained
here on a fixed corpus, saved as a transformers fast tokenizer. The directory loads in
both vLLM and transformers. CPU attention in vLLM needs head_dim >= 32, hence 128 / 4.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

SEED = 0
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "vocab_size": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "float32",
}
# Special tokens first, so their ids are the ones CONFIG names.
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "The Eiffel Tower is in Paris, and the Colosseum is in Rome.",
    "The capital of Japan is Tokyo; the capital of France is Paris.",
    "A job queue runs many traces on one engine and batches them together.",
    "Hello world! Numbers like 0 1 2 3 4 5 6 7 8 9 appear in text too.",
    "Interventions read and write the hidden states of every decoder layer.",
]
_MARKER = ".tiny-llama-build"


def _fingerprint() -> str:
    spec = {"seed": SEED, "config": CONFIG, "special": SPECIAL_TOKENS, "corpus": CORPUS}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def build_tiny_llama(path: str | Path) -> Path:
    """Build the checkpoint into ``path`` and return it; a no-op if this spec is already there."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    marker = path / _MARKER
    fingerprint = _fingerprint()
    if marker.is_file() and marker.read_text() == fingerprint:
        return path
    path.mkdir(parents=True, exist_ok=True)

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=CONFIG["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS * 8, trainer=trainer)
    # Prepend BOS on encode, as Llama tokenizers do, so vLLM and transformers see the same ids.
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", CONFIG["bos_token_id"])]
    )
    assert [bpe.token_to_id(token) for token in SPECIAL_TOKENS] == [0, 1, 2]
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(
        path
    )

    torch.manual_seed(SEED)
    config = LlamaConfig(**{key: value for key, value in CONFIG.items() if key != "architectures"})
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)

    marker.write_text(fingerprint)
    return path


# Engine arguments for the tiny model, the same for in-process engines, worker processes and client models.
TINY_ENGINE_KWARGS = {"dtype": "float32", "max_model_len": 256, "seed": 0}
# The locations a tapped engine of the tiny model serves (nnsight's ``VLLM(..., taps=TAPS)``, ``nnqueue worker``'s
# NNQUEUE_ENGINE_TAPS): every layer's input and output and the final norm's input.
TAPS = ["model.layers.*.output", "model.layers.*.input", "model.norm.input"]
