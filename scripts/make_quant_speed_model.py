#!/usr/bin/env python3
"""A speed model of a K-quant GGUF: a bf16 GGUF (e.g. llama.cpp's conversion of
`scripts/make_model.py --shape qwen2.5-0.5b`) with every matrix replaced by random blocks with
finite scales (the values mean nothing; the kernels and bytes are those of a quantised file).

    python3 scripts/make_quant_speed_model.py SRC-bf16.gguf OUT.gguf Q4_K

Matrices whose rows are a multiple of 256 get the named K type; the others get Q5_0 (the
embedding Q8_0), the type llama.cpp's quantiser falls back to from Q4_K for such rows
(`tensor_type_fallback` in llama-quant.cpp). On the Qwen2.5-0.5B shape (hidden 896) that makes
ffn_down Q4_K and every other matrix Q5_0, close to what llama.cpp's Q4_K_M gives that model (it
also puts Q6_K, or its fallback Q8_0, on attn_v and half of ffn_down). Needs `gguf` and `numpy`.
"""
import sys
import numpy as np
import gguf
from gguf import GGUFReader, GGUFWriter, GGMLQuantizationType as T
src, dst, qname = sys.argv[1], sys.argv[2], sys.argv[3]
qt = getattr(T, qname)
r = GGUFReader(src)
arch = r.fields["general.architecture"].contents()
w = GGUFWriter(dst, arch)
for name, f in r.fields.items():
    if name.startswith("GGUF.") or name == "general.architecture":
        continue
    vt = f.types[0]
    sub = f.types[1] if len(f.types) > 1 else None
    w.add_key_value(name, f.contents(), vt, sub_type=sub)
rng = np.random.default_rng(0)
F16 = {T.Q5_0: [0], T.Q4_K: [0, 2], T.Q6_K: [208], T.Q8_0: [0], T.Q5_K: [0, 2]}
for t in r.tensors:
    shape = [int(x) for x in t.shape]  # ggml order: [cols, rows]
    if len(shape) == 2:
        cols, rows = shape
        q = qt if cols % 256 == 0 else (T.Q8_0 if t.name == "token_embd.weight" else T.Q5_0)
        be, bs = gguf.GGML_QUANT_SIZES[q]
        n = rows * cols // be
        b = rng.integers(0, 256, size=(n, bs), dtype=np.uint8)
        for off in F16[q]:
            b[:, off:off + 2] = rng.uniform(-0.05, 0.05, size=n).astype(np.float16).view(np.uint8).reshape(n, 2)
        w.add_tensor(t.name, b.reshape(rows, -1), raw_dtype=q)
    else:
        data = np.array(t.data)
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
