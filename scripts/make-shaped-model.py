#!/usr/bin/env python3
"""Write a random-weight GGUF with the shape of a real model, for benchmarks.

The file has the architecture metadata and the tensor names and shapes that
llama.cpp's converter writes for the chosen model (--shape):

  llama-3.2-1b  llama, 2048 wide, 16 layers, 32 heads / 8 KV heads (head 64),
                FFN 8192, rope base 500000, rms eps 1e-5, tied output
  qwen3-0.6b    qwen3, 1024 wide, 28 layers, 16 heads / 8 KV heads (head 128,
                so Q is 2048 wide), FFN 3072, rope base 1e6, rms eps 1e-6,
                per-layer attn_q_norm / attn_k_norm, tied output

Tiny shapes, one per architecture Pie serves, for comparing forward passes
with llama.cpp (scripts/oracle-llama-cpp.py); all 64 wide, 4 heads / 2 KV
heads, FFN 128, untied output.weight (but Gemma 2's):

  tiny-llama    2 layers, head 16, rope base 10000
  tiny-qwen2    2 layers, head 16, Q/K/V biases, rope base 1e6
  tiny-qwen3    2 layers, head 32 (key_length wider than hidden / heads),
                attn_q_norm / attn_k_norm, rope base 1e6
  tiny-phi3     2 layers, head 16, fused attn_qkv and ffn_up (gate rows, then up)
  tiny-gemma3   6 layers (layer 5 global), head 32, q/k norms, post-attention
                and post-FFN norms, sliding_window 8, rope base 1e6 (llama.cpp's
                and Pie's sliding-window layers use 10000)
  tiny-gemma2   4 layers (every other one windowed, sliding_window 8), head 32,
                post-attention and post-FFN norms, attention scores capped
                at 50 and logits at 30, output tied to token_embd (llama.cpp
                reads no output.weight for gemma2)
  tiny-qwen2-yarn  tiny-qwen2 with YaRN: rope.scaling factor 4 over an
                original context of 64 (pair 1 on the ramp between pair 0,
                kept, and pairs 2-7, interpolated)
  tiny-qwen2-yarn1024  the same over 1024 (pairs 1 and 2 on the ramp)
  tiny-qwen2-linear    tiny-qwen2 with linear scaling by 4

Their weights are seeded normal with std 1.5 / sqrt(fan_in) (embedding std 1,
Gemma's 1 / sqrt(hidden) since it is scaled up by sqrt(hidden); output std
4 / sqrt(hidden); biases std 0.5), so logits have clear margins; norms are
ones plus 0.1 noise. Matrices are F32, except token_embd and output, F16, to
keep the file near 14 MB; with --tiny-type q8_0 every matrix is Q8_0 (about
4 MB), which llama.cpp and Pie both read bit for bit and multiply with 8-bit
activations. Use them with --quantize none.

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
from gguf import (GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter,
                  RopeScalingType, quants)

SHAPES = {
    "llama-3.2-1b": dict(arch="llama", n_embd=2048, n_layer=16, n_head=32, n_head_kv=8,
                         head_dim=64, n_ff=8192, n_ctx=8192, rope_base=500000.0,
                         rms_eps=1e-5, qk_norm=False),
    "qwen3-0.6b": dict(arch="qwen3", n_embd=1024, n_layer=28, n_head=16, n_head_kv=8,
                       head_dim=128, n_ff=3072, n_ctx=8192, rope_base=1000000.0,
                       rms_eps=1e-6, qk_norm=True),
}
_TINY = dict(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, n_ctx=1024,
             rope_base=10000.0, rms_eps=1e-5, qk_norm=False, tiny=True)
SHAPES.update({
    "tiny-llama": dict(_TINY, arch="llama"),
    "tiny-qwen2": dict(_TINY, arch="qwen2", rope_base=1e6, rms_eps=1e-6, qkv_bias=True),
    "tiny-qwen3": dict(_TINY, arch="qwen3", rope_base=1e6, rms_eps=1e-6, head_dim=32,
                       qk_norm=True),
    "tiny-phi3": dict(_TINY, arch="phi3", fused=True),
    "tiny-gemma3": dict(_TINY, arch="gemma3", n_layer=6, head_dim=32, rope_base=1e6,
                        rms_eps=1e-6, qk_norm=True, post_norms=True, sliding_window=8),
    "tiny-gemma2": dict(_TINY, arch="gemma2", n_layer=4, head_dim=32, rms_eps=1e-6,
                        post_norms=True, sliding_window=8, softcaps=(50.0, 30.0), tied=True),
})
SHAPES["tiny-qwen2-yarn"] = dict(SHAPES["tiny-qwen2"], yarn=(4.0, 64))
SHAPES["tiny-qwen2-yarn1024"] = dict(SHAPES["tiny-qwen2"], yarn=(4.0, 1024))
SHAPES["tiny-qwen2-linear"] = dict(SHAPES["tiny-qwen2"], linear=4.0)
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
    """(name, numpy shape (out, in), kind) for every tensor, in file order;
    kind is norm, bias, embd, output or weight."""
    d, ff, hd = s["n_embd"], s["n_ff"], s["head_dim"]
    q, kv = s["n_head"] * hd, s["n_head_kv"] * hd
    yield "token_embd.weight", (n_vocab, d), "embd"
    for i in range(s["n_layer"]):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (d,), "norm"
        if s.get("fused"):
            yield b + "attn_qkv.weight", (q + 2 * kv, d), "weight"
        else:
            yield b + "attn_q.weight", (q, d), "weight"
            yield b + "attn_k.weight", (kv, d), "weight"
            yield b + "attn_v.weight", (kv, d), "weight"
        if s.get("qkv_bias"):
            yield b + "attn_q.bias", (q,), "bias"
            yield b + "attn_k.bias", (kv,), "bias"
            yield b + "attn_v.bias", (kv,), "bias"
        if s["qk_norm"]:
            yield b + "attn_q_norm.weight", (hd,), "norm"
            yield b + "attn_k_norm.weight", (hd,), "norm"
        yield b + "attn_output.weight", (d, q), "weight"
        if s.get("post_norms"):
            yield b + "post_attention_norm.weight", (d,), "norm"
        yield b + "ffn_norm.weight", (d,), "norm"
        if s.get("fused"):
            yield b + "ffn_up.weight", (2 * ff, d), "weight"
        else:
            yield b + "ffn_gate.weight", (ff, d), "weight"
            yield b + "ffn_up.weight", (ff, d), "weight"
        yield b + "ffn_down.weight", (d, ff), "weight"
        if s.get("post_norms"):
            yield b + "post_ffw_norm.weight", (d,), "norm"
    yield "output_norm.weight", (d,), "norm"
    if s.get("tiny") and not s.get("tied"):
        yield "output.weight", (n_vocab, d), "output"


def tensor_type(s, kind, tiny_type):
    """The GGML type a tensor of `kind` is written as."""
    if kind in ("norm", "bias"):
        return GGMLQuantizationType.F32
    if s.get("tiny") and tiny_type == "q8_0":
        return GGMLQuantizationType.Q8_0
    if not s.get("tiny") or kind in ("embd", "output"):
        return GGMLQuantizationType.F16
    return GGMLQuantizationType.F32


def random_tensor(rng, s, shape, kind):
    """Norms: ones plus noise (1e-3; tiny shapes 0.1). Other tensors normal:
    std 0.02, or for tiny shapes as the docstring says."""
    x = rng.standard_normal(shape, dtype=np.float32)
    if kind == "norm":
        return 1.0 + (0.1 if s.get("tiny") else 1e-3) * x
    if not s.get("tiny"):
        return 0.02 * x
    d = s["n_embd"]
    std = {"bias": 0.5, "output": 4 / np.sqrt(d),
           "embd": 1 / np.sqrt(d) if s["arch"] == "gemma3" else 1.0}
    return x * std.get(kind, 1.5 / np.sqrt(shape[-1]))


def encode(x, qtype):
    """`x` as the bytes (or array) GGUFWriter writes for `qtype`."""
    if qtype == GGMLQuantizationType.Q8_0:
        return quants.quantize(x, qtype)
    return x.astype(np.float16 if qtype == GGMLQuantizationType.F16 else np.float32)


def add_metadata(w, name, s, n_vocab, tokenizer):
    """Architecture hyperparameters plus the copied tokenizer keys."""
    w.add_name(name)
    w.add_file_type(s.get("file_type", 1))  # 1: LLAMA_FTYPE_MOSTLY_F16
    w.add_context_length(s["n_ctx"])
    w.add_embedding_length(s["n_embd"])
    w.add_block_count(s["n_layer"])
    w.add_feed_forward_length(s["n_ff"])
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_head_kv"])
    w.add_rope_freq_base(s["rope_base"])
    w.add_layer_norm_rms_eps(s["rms_eps"])
    w.add_vocab_size(n_vocab)
    if s["arch"] in ("qwen3", "gemma2", "gemma3") or s["head_dim"] * s["n_head"] != s["n_embd"]:
        w.add_key_length(s["head_dim"])
        w.add_value_length(s["head_dim"])
    else:
        w.add_rope_dimension_count(s["head_dim"])
    if s.get("sliding_window"):
        w.add_sliding_window(s["sliding_window"])
    if s.get("linear"):
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(s["linear"])
    if s.get("yarn"):
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(s["yarn"][0])
        w.add_rope_scaling_orig_ctx_len(s["yarn"][1])
    if s.get("softcaps"):
        w.add_attn_logit_softcapping(s["softcaps"][0])
        w.add_final_logit_softcapping(s["softcaps"][1])
    for key, value, vtype, sub_type in tokenizer:
        w.add_key_value(key, value, vtype, sub_type)


def write_f16(path, shape_name, vocab_from, seed, tiny_type="f32"):
    """Write the F16/F32 (tiny shapes: F32/Q8_0) GGUF, one tensor at a time."""
    s = dict(SHAPES[shape_name])
    if s.get("tiny"):
        s["file_type"] = 7 if tiny_type == "q8_0" else 0  # MOSTLY_Q8_0, ALL_F32
    tokenizer = read_tokenizer(vocab_from)
    n_vocab = len(next(v for k, v, _, _ in tokenizer if k == "tokenizer.ggml.tokens"))
    tensors = [(n, shape, kind, tensor_type(s, kind, tiny_type))
               for n, shape, kind in tensor_shapes(s, n_vocab)]
    w = GGUFWriter(str(path), s["arch"])
    # llama.cpp special-cases a general.name containing "phi3" (and fails on
    # a vocabulary without Phi-3's special tokens): tiny shapes avoid names.
    name = "random tiny model" if s.get("tiny") else f"{shape_name}-shaped"
    add_metadata(w, name, s, n_vocab, tokenizer)
    for name, shape, _, qtype in tensors:
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // block * block_bytes
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, shape, kind, qtype in tensors:
        w.write_tensor_data(encode(random_tensor(rng, s, shape, kind), qtype))
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
    p.add_argument("--tiny-type", choices=["f32", "q8_0"], default="f32",
                   help="tiny shapes' matrices (f32: token_embd and output F16)")
    p.add_argument("--vocab-from", type=Path, default=DEFAULT_VOCAB,
                   help="GGUF whose tokenizer.* keys are copied")
    a = p.parse_args()

    a.out_dir.mkdir(parents=True, exist_ok=True)
    f16 = a.out_dir / f"{a.shape}-shaped.f16.gguf"
    write_f16(f16, a.shape, a.vocab_from, a.seed, a.tiny_type)
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
