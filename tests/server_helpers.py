"""The endpoint in tests: served on a loopback socket by uvicorn on a thread, and a tiny local
checkpoint (a random small Llama and a BPE tokenizer trained offline) built on the spot."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

CORPUS = ["the quick brown fox jumps over the lazy dog", "serving many models on one cluster",
          "tokens per second per device", "a prefill chunk and a decode step", "hello world"] * 20


def tiny_checkpoint(folder: Path) -> Path:
    """A Llama of two 64-wide layers and its byte-level BPE tokenizer (with a chat template),
    saved as a Hugging Face checkpoint folder (config.json, model.safetensors, tokenizer)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")
    fast.save_pretrained(folder)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.1, bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                      tie_word_embeddings=False)
    torch.manual_seed(11)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(folder)
    return folder


@contextmanager
def serving(app):
    """The app on a loopback port of its own; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    end = time.monotonic() + 60
    while not server.started and thread.is_alive() and time.monotonic() < end:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
