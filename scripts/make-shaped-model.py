#!/usr/bin/env python3
"""Write a random-weight GGUF with the shape of a real model, for benchmarks.

The file has the architecture metadata and the tensor names and shapes that
llama.cpp's converter writes for the chosen model (--shape):

  llama-3.2-1b  llama, 2048 wide, 16 layers, 32 heads / 8 KV heads (head 64),
                FFN 8192, rope base 500000, rms eps 1e-5, tied output
  qwen3-0.6b    qwen3, 1024 wide, 28 layers, 16 heads / 8 KV heads (head 128,
                so Q is 2048 wide), FFN 3072, rope base 1e6, rms eps 1e-6,
                per-layer attn_q_norm / attn_k_norm, tied output

Its vocabulary is SmolLM2's (49,152 tokens): every tokenizer.* key is copied
from a reference GGUF (--vocab-from, default the SmolLM2-135M model Pie
downloads). Weights are seeded (--seed) normal with std 0.02, written as F16;
norm weights are ones plus 1e-3 noise, written as F32. The output is therefore
a model of the right size and speed whose text is gibberish.

With --quantize TYPE (default Q4_K_M) and a llama.cpp build (--llama-cpp-bin or
$LLAMA_CPP_BIN, the directory holding llama-quantize), the F16 file is then run
through `llama-quantize IN.f16.gguf OUT.TYPE.gguf TYPE` and deleted unless
--keep-f16. The result is OUT_DIR/<shape>-shaped.<TYPE>.gguf. Needs the `gguf`
and `numpy` packages (pip install gguf numpy).

    LLAMA_CPP_BIN=/work/llamacpp/build/bin scripts/make-shaped-model.py --shape qwen3-0.6b
"""

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

SHAPES = {
    "llama-3.2-1b": dict(arch="llama", n_embd=2048, n_layer=16, n_head=32, n_head_kv=8,
                         head_dim=64, n_ff=8192, n_ctx=8192, rope_base=500000.0,
                         rms_eps=1e-5, qk_norm=False),
    "qwen3-0.6b": dict(arch="qwen3", n_embd=1024, n_layer=28, n_head=16, n_head_kv=8,
                       head_dim=128, n_ff=3072, n_ctx=8192, rope_base=1000000.0,
                       rms_eps=1e-6, qk_norm=True),
}
DEFAULT_VOCAB = Path.home() / ".cache/pie/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def read_tokenizer(path):
    """The tokenizer.* key/values of a GGUF file, as (key, value, type, sub_type)."""
    out = []
    for key, field in GGUFReader(path).fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        out.append((key, field.contents(), vtype, sub_type))
    return out


def tensor_shapes(s, n_vocab):
    """(name, numpy shape (out, in), is_norm) for every tensor, in file order."""
    d, ff, hd = s["n_embd"], s["n_ff"], s["head_dim"]
    q, kv = s["n_head"] * hd, s["n_head_kv"] * hd
    yield "token_embd.weight", (n_vocab, d), False
    for i in range(s["n_layer"]):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (d,), True
        yield b + "attn_q.weight", (q, d), False
        yield b + "attn_k.weight", (kv, d), False
        yield b + "attn_v.weight", (kv, d), False
        if s["qk_norm"]:
            yield b + "attn_q_norm.weight", (hd,), True
            yield b + "attn_k_norm.weight", (hd,), True
        yield b + "attn_output.weight", (d, q), False
        yield b + "ffn_norm.weight", (d,), True
        yield b + "ffn_gate.weight", (ff, d), False
        yield b + "ffn_up.weight", (ff, d), False
        yield b + "ffn_down.weight", (d, ff), False
    yield "output_norm.weight", (d,), True


def random_tensor(rng, shape, is_norm):
    """Norms: ones plus small noise, F32. Weights: N(0, 0.02), F16."""
    if is_norm:
        return (1.0 + 1e-3 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    return (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float16)


def add_metadata(w, name, s, n_vocab, tokenizer):
    """Architecture hyperparameters plus the copied tokenizer keys."""
    w.add_name(name)
    w.add_file_type(1)  # LLAMA_FTYPE_MOSTLY_F16
    w.add_context_length(s["n_ctx"])
    w.add_embedding_length(s["n_embd"])
    w.add_block_count(s["n_layer"])
    w.add_feed_forward_length(s["n_ff"])
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_head_kv"])
    w.add_rope_freq_base(s["rope_base"])
    w.add_layer_norm_rms_eps(s["rms_eps"])
    w.add_vocab_size(n_vocab)
    if s["arch"] == "qwen3":
        w.add_key_length(s["head_dim"])
        w.add_value_length(s["head_dim"])
    else:
        w.add_rope_dimension_count(s["head_dim"])
    for key, value, vtype, sub_type in tokenizer:
        w.add_key_value(key, value, vtype, sub_type)


def write_f16(path, shape_name, vocab_from, seed):
    """Write the F16/F32 GGUF, generating one tensor at a time."""
    s = SHAPES[shape_name]
    tokenizer = read_tokenizer(vocab_from)
    n_vocab = len(next(v for k, v, _, _ in tokenizer if k == "tokenizer.ggml.tokens"))
    tensors = list(tensor_shapes(s, n_vocab))
    w = GGUFWriter(str(path), s["arch"])
    add_metadata(w, f"{shape_name}-shaped", s, n_vocab, tokenizer)
    for name, shape, is_norm in tensors:
        dtype = np.float32 if is_norm else np.float16
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape, is_norm in tensors:
        w.write_tensor_data(random_tensor(rng, shape, is_norm))
    w.close()


def find_quantize(bin_dir):
    """Path of llama-quantize in bin_dir (or on PATH), or None."""
    if bin_dir:
        exe = Path(bin_dir) / "llama-quantize"
        return exe if exe.is_file() and os.access(exe, os.X_OK) else None
    found = shutil.which("llama-quantize")
    return Path(found) if found else None


def quantize(exe, src, dst, qtype):
    subprocess.run([str(exe), str(src), str(dst), qtype], check=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    p.add_argument("--out-dir", type=Path, default=Path("/work/models"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantize", default="Q4_K_M", help="llama-quantize type, or 'none' to keep F16")
    p.add_argument("--llama-cpp-bin", default=os.environ.get("LLAMA_CPP_BIN"),
                   help="directory holding llama-quantize (default $LLAMA_CPP_BIN, else PATH)")
    p.add_argument("--keep-f16", action="store_true")
    p.add_argument("--vocab-from", type=Path, default=DEFAULT_VOCAB,
                   help="GGUF whose tokenizer.* keys are copied")
    a = p.parse_args()

    a.out_dir.mkdir(parents=True, exist_ok=True)
    f16 = a.out_dir / f"{a.shape}-shaped.f16.gguf"
    write_f16(f16, a.shape, a.vocab_from, a.seed)
    out = f16
    if a.quantize.lower() != "none":
        exe = find_quantize(a.llama_cpp_bin)
        if exe is None:
            print(f"llama-quantize not found (set LLAMA_CPP_BIN); leaving {f16}", file=sys.stderr)
        else:
            out = a.out_dir / f"{a.shape}-shaped.{a.quantize}.gguf"
            quantize(exe, f16, out, a.quantize)
            if not a.keep_f16:
                f16.unlink()
    print(f"{out} {out.stat().st_size} bytes ({out.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
