//! Emitters: one per kernel family. An emitter does not compute; it writes the MLIR that will
//! compute one [`Kernel`] for one exact shape, with every dimension a constant.
//!
//! Each kernel becomes its own module holding one public `func.func` with the ABI signature of
//! [`kiln_core::abi`]: nine statically shaped memrefs (lowered to bare pointers) and the work
//! counter, followed by `rows`, `thread_id` and `n_threads` as i64.

mod attention;
mod delta_chunk;
mod delta_net;
mod elementwise;
mod gate_up;
mod matmul;
mod norm;
mod probe;
mod q8_layouts;
mod quant;
pub(crate) mod quant8;
mod recurrent;
mod rope;

use crate::ir::{Cmp, Kb, build_func};
use kiln_core::{CompileOptions, DType, Kernel, NormShape, abi};
use melior::{
    Context,
    ir::{
        Attribute, BlockLike, Identifier, Location, Module, Type, Value, attribute::TypeAttribute,
        operation::OperationBuilder,
    },
};

/// Run-time scalars every kernel receives, already converted to `index`.
#[derive(Clone, Copy)]
pub struct Dyn<'c, 'a> {
    pub rows: Value<'c, 'a>,
    pub tid: Value<'c, 'a>,
    pub nth: Value<'c, 'a>,
    /// This call's work counter (`memref<8xi64>`, zero on entry; see [`split_work`]).
    pub work: Value<'c, 'a>,
}

/// The MLIR memref type of one kernel argument.
pub fn memref(shape: &[usize], elem: &str) -> String {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("memref<{}x{elem}>", dims.join("x"))
}

/// Element type name of weights of a plain float storage type.
pub fn elem(dtype: DType) -> &'static str {
    assert!(
        !dtype.is_quantized(),
        "{dtype} weights are passed as rows of bytes (see `weight_matrix`)"
    );
    dtype.name()
}

/// The memref type of a `[rows, cols]` weight matrix: its elements for float types, and for
/// quantised types its rows of bytes (`cols / block_elems` GGML blocks each), so that a row is
/// addressed by its index and a block by its byte offset within the row.
pub fn weight_matrix(rows: usize, cols: usize, dtype: DType) -> String {
    if dtype.is_quantized() {
        assert!(
            dtype.fits(cols),
            "a row of {cols} {dtype} values is not a whole number of blocks"
        );
        memref(&[rows, dtype.bytes_for(cols)], "i8")
    } else {
        memref(&[rows, cols], elem(dtype))
    }
}

/// Builds the module for one kernel.
pub fn emit_kernel<'c>(ctx: &'c Context, kernel: &Kernel, opts: &CompileOptions) -> Module<'c> {
    let loc = Location::unknown(ctx);
    let module = Module::new(loc);
    let mut arg_types: Vec<String> = arg_types(kernel);
    assert!(arg_types.len() <= abi::BUFFER_ARGS);
    arg_types.resize(abi::BUFFER_ARGS, "memref<1xi8>".to_string());
    arg_types.push(format!("memref<{}xi64>", abi::WORK_COUNTER_BYTES / 8));
    arg_types.extend(std::iter::repeat_n("i64".to_string(), 3));
    let types: Vec<Type> = arg_types
        .iter()
        .map(|t| Type::parse(ctx, t).unwrap_or_else(|| panic!("invalid type {t}")))
        .collect();
    // Constant tables the kernel needs live in the same module as private globals.
    if let Kernel::RopeKv {
        rotary: Some(rotary), ..
    } = kernel
    {
        module
            .body()
            .append_operation(constant_table(ctx, rope::INV_FREQ, &rotary.inv_freq));
        if let Some(long) = &rotary.long {
            module
                .body()
                .append_operation(constant_table(ctx, rope::INV_FREQ_LONG, &long.inv_freq));
        }
    }
    let func = build_func(ctx, &kernel.symbol(), &types, true, |b, args| {
        let index = b.index_ty();
        let d = Dyn {
            rows: b.index_cast(args[abi::PTR_ARGS], index),
            tid: b.index_cast(args[abi::PTR_ARGS + 1], index),
            nth: b.index_cast(args[abi::PTR_ARGS + 2], index),
            work: args[abi::WORK_COUNTER_ARG],
        };
        let p = &args[..abi::PTR_ARGS];
        let lanes = opts.f32_lanes;
        match kernel {
            Kernel::Embed { .. } => elementwise::emit_embed(b, kernel, p, d, lanes),
            Kernel::Norm { .. } => norm::emit_norm(b, kernel, p, d, lanes),
            Kernel::MatMul { .. } => matmul::emit_matmul(b, kernel, p, d, lanes, opts),
            Kernel::GateUp { .. } => gate_up::emit_gate_up(b, kernel, p, d, lanes, opts),
            Kernel::RopeKv { .. } => rope::emit_rope_kv(b, kernel, p, d, lanes),
            Kernel::Attention { .. } => attention::emit_attention(b, kernel, p, d, lanes),
            Kernel::GatedAct { .. } => elementwise::emit_gated_act(b, kernel, p, d, lanes),
            Kernel::Add { .. } => elementwise::emit_add(b, kernel, p, d, lanes),
            Kernel::ProbeRead { .. } => probe::emit_probe_read(b, kernel, p, d, lanes),
            Kernel::ProbeFma { .. } => probe::emit_probe_fma(b, kernel, p, d, lanes),
            Kernel::CausalConv { .. } => recurrent::emit_causal_conv(b, kernel, p, d, lanes),
            Kernel::DeltaGates { .. } => delta_net::emit_delta_gates(b, kernel, p, d, lanes),
            Kernel::DeltaNet { .. } => delta_net::emit_delta_net(b, kernel, p, d, lanes),
            Kernel::GatedNorm { .. } => recurrent::emit_gated_norm(b, kernel, p, d, lanes),
        }
    });
    module.body().append_operation(func);
    module
}

/// The module exporting `kiln_abi_version`, checked by the runtime when it loads a library.
pub fn emit_abi_module(ctx: &Context) -> Module<'_> {
    let loc = Location::unknown(ctx);
    let module = Module::new(loc);
    let fty = Type::parse(ctx, "() -> i32").expect("type");
    let block = melior::ir::Block::new(&[]);
    {
        let b = Kb { ctx, loc, blk: &block };
        let v = b.i32c(abi::ABI_VERSION as i32);
        b.op("func.return", &[v], &[], &[]);
    }
    let region = melior::ir::Region::new();
    melior::ir::RegionLike::append_block(&region, block);
    let func = OperationBuilder::new("func.func", loc)
        .add_attributes(&[
            (
                Identifier::new(ctx, "sym_name"),
                Attribute::parse(ctx, &format!("\"{}\"", abi::ABI_VERSION_SYMBOL)).expect("name"),
            ),
            (Identifier::new(ctx, "function_type"), TypeAttribute::new(fty).into()),
        ])
        .add_regions([region])
        .build()
        .expect("valid func");
    module.body().append_operation(func);
    module
}

/// The memref types of a kernel's pointer arguments, in ABI order.
fn arg_types(kernel: &Kernel) -> Vec<String> {
    // A norm's weight and, for LayerNorm with a bias, its bias.
    let norm_args = |dim: usize, n: &NormShape| {
        let mut v = vec![memref(&[dim], elem(n.wdtype))];
        v.extend(n.bias.map(|b| memref(&[dim], elem(b))));
        v
    };
    match kernel {
        Kernel::Embed {
            vocab,
            hidden,
            dtype,
            positions,
            max_rows,
            ..
        } => {
            let mut v = vec![
                memref(&[*max_rows], "i32"),
                weight_matrix(*vocab, *hidden, *dtype),
                memref(&[*max_rows, *hidden], "f32"),
            ];
            if let Some(p) = positions {
                v.extend([weight_matrix(p.rows, *hidden, p.dtype), row_info(*max_rows)]);
            }
            v
        }
        Kernel::Norm {
            dim, norm, max_rows, ..
        } => {
            let mut v = vec![memref(&[*max_rows, *dim], "f32")];
            let mut nw = norm_args(*dim, norm);
            v.push(nw.remove(0));
            v.push(memref(&[*max_rows, *dim], "f32"));
            v.extend(nw);
            v
        }
        Kernel::MatMul {
            n,
            k,
            wdtype,
            bias,
            norm,
            max_rows,
            ..
        } => {
            let mut v = vec![
                memref(&[*max_rows, *k], "f32"),
                weight_matrix(*n, *k, *wdtype),
                memref(&[*max_rows, *n], "f32"),
            ];
            if let Some(b) = bias {
                v.push(memref(&[*n], elem(*b)));
            }
            if let Some(nm) = norm {
                v.extend(norm_args(*k, nm));
            }
            v
        }
        Kernel::GateUp {
            n,
            k,
            gate_dtype,
            up_dtype,
            norm,
            max_rows,
            ..
        } => {
            let mut v = vec![
                memref(&[*max_rows, *k], "f32"),
                weight_matrix(*n, *k, *gate_dtype),
                memref(&[*max_rows, *n], "f32"),
                weight_matrix(*n, *k, *up_dtype),
                memref(&[*max_rows, *n], "f32"),
            ];
            if let Some(nm) = norm {
                v.extend(norm_args(*k, nm));
            }
            v
        }
        Kernel::RopeKv {
            heads,
            kv_heads,
            head_dim,
            qk_norm,
            ctx,
            max_rows,
            kv,
            ..
        } => {
            let mut v = vec![
                memref(&[*max_rows, heads * head_dim], "f32"),
                memref(&[*max_rows, kv_heads * head_dim], "f32"),
                memref(&[*max_rows, kv_heads * head_dim], "f32"),
                kv_cache(*kv_heads, *ctx, *head_dim, *kv),
                kv_cache(*kv_heads, *ctx, *head_dim, *kv),
            ];
            if let Some(n) = qk_norm {
                v.push(memref(&[*head_dim], elem(n.q_dtype)));
                v.push(memref(&[*head_dim], elem(n.k_dtype)));
            }
            v.push(row_info(*max_rows));
            v
        }
        Kernel::Attention {
            heads,
            kv_heads,
            head_dim,
            ctx,
            max_rows,
            kv,
            ..
        } => vec![
            memref(&[*max_rows, heads * head_dim], "f32"),
            // Flat views: a block of keys is one run of rows, addressed from one start.
            memref(&[abi::MAX_SLOTS * kv_heads * ctx * head_dim], elem(*kv)),
            memref(&[abi::MAX_SLOTS * kv_heads * ctx * head_dim], elem(*kv)),
            memref(&[*max_rows, heads * head_dim], "f32"),
            row_info(*max_rows),
        ],
        // Flat views: the elementwise kernels walk rows * dim contiguous values.
        Kernel::GatedAct { dim, max_rows, .. } | Kernel::Add { dim, max_rows } => {
            vec![memref(&[max_rows * dim], "f32"), memref(&[max_rows * dim], "f32")]
        }
        Kernel::ProbeRead { elems } => vec![memref(&[*elems], "f32"), memref(&[64, 16], "f32")],
        Kernel::ProbeFma { .. } => vec![memref(&[64, 16], "f32")],
        Kernel::CausalConv {
            channels,
            taps,
            wdtype,
            max_rows,
        } => vec![
            memref(&[*max_rows, *channels], "f32"),
            memref(&[channels * taps], elem(*wdtype)),
            memref(&[*max_rows, *channels], "f32"),
            memref(&[abi::MAX_SLOTS, (taps - 1) * channels], "f32"),
            row_info(*max_rows),
        ],
        Kernel::DeltaGates {
            k_heads,
            v_heads,
            k_dim,
            v_dim,
            a_dtype,
            dt_dtype,
            max_rows,
            ..
        } => vec![
            memref(&[*max_rows, 2 * k_heads * k_dim + v_heads * v_dim], "f32"),
            memref(&[*max_rows, *v_heads], "f32"),
            memref(&[*max_rows, *v_heads], "f32"),
            memref(&[*v_heads], elem(*a_dtype)),
            memref(&[*v_heads], elem(*dt_dtype)),
        ],
        Kernel::DeltaNet {
            k_heads,
            v_heads,
            k_dim,
            v_dim,
            max_rows,
            ..
        } => vec![
            memref(&[*max_rows, 2 * k_heads * k_dim + v_heads * v_dim], "f32"),
            memref(&[*max_rows, *v_heads], "f32"),
            memref(&[*max_rows, *v_heads], "f32"),
            memref(&[*max_rows, v_heads * v_dim], "f32"),
            memref(&[abi::MAX_SLOTS * v_heads * k_dim * v_dim], "f32"),
            row_info(*max_rows),
        ],
        Kernel::GatedNorm {
            width,
            dim,
            wdtype,
            max_rows,
            ..
        } => vec![
            memref(&[*max_rows, *width], "f32"),
            memref(&[*max_rows, *width], "f32"),
            memref(&[*dim], elem(*wdtype)),
        ],
    }
}

/// A KV cache as the kernels address it: every slot's heads, each `ctx` rows of `head_dim`
/// (row `(slot * kv_heads + head) * ctx + position`).
fn kv_cache(kv_heads: usize, ctx: usize, head_dim: usize, kv: DType) -> String {
    memref(&[abi::MAX_SLOTS * kv_heads * ctx, head_dim], elem(kv))
}

/// The per-row positions and slots (`kiln_core::graph::RowInfo`).
fn row_info(max_rows: usize) -> String {
    memref(&[max_rows, kiln_core::graph::ROW_INFO_LEN], "i32")
}

/// Row `r`'s position, slot and sequence end as indices.
pub struct RowPlace<'c, 'a> {
    pub position: Value<'c, 'a>,
    pub slot: Value<'c, 'a>,
    pub seq_end: Value<'c, 'a>,
}

/// Reads row `r` of the `row_info` buffer.
pub fn row_place<'c, 'a>(b: Kb<'c, 'a>, row_info: Value<'c, '_>, r: Value<'c, '_>) -> RowPlace<'c, 'a> {
    use kiln_core::graph::row_info as f;
    let get = |i: usize| b.load_i32_index(row_info, &[r, b.idx(i)]);
    RowPlace {
        position: get(f::POSITION),
        slot: get(f::SLOT),
        seq_end: get(f::SEQ_END),
    }
}

/// A private constant f32 table `@name` (values given by their bits, stored exactly).
fn constant_table<'c>(ctx: &'c Context, name: &str, bits: &[u32]) -> melior::ir::Operation<'c> {
    let hex: String = bits
        .iter()
        .flat_map(|b| b.to_le_bytes())
        .map(|b| format!("{b:02X}"))
        .collect();
    let n = bits.len();
    let value = Attribute::parse(ctx, &format!("dense<\"0x{hex}\"> : tensor<{n}xf32>")).expect("dense table");
    let ty = Type::parse(ctx, &format!("memref<{n}xf32>")).expect("table type");
    OperationBuilder::new("memref.global", Location::unknown(ctx))
        .add_attributes(&[
            (
                Identifier::new(ctx, "sym_name"),
                Attribute::parse(ctx, &format!("\"{name}\"")).expect("name"),
            ),
            (
                Identifier::new(ctx, "sym_visibility"),
                Attribute::parse(ctx, "\"private\"").expect("vis"),
            ),
            (Identifier::new(ctx, "type"), TypeAttribute::new(ty).into()),
            (Identifier::new(ctx, "initial_value"), value),
            (Identifier::new(ctx, "constant"), Attribute::unit(ctx)),
        ])
        .build()
        .expect("valid memref.global")
}

/// This thread's share `[start, end)` of `total` work items, in chunks that are multiples of
/// `align` (so only the last thread meets a remainder).
pub fn thread_range<'c, 'a>(
    b: Kb<'c, 'a>,
    total: Value<'c, '_>,
    d: Dyn<'c, '_>,
    align: usize,
) -> (Value<'c, 'a>, Value<'c, 'a>) {
    let per = b.ceildivui(total, d.nth);
    let chunk = if align > 1 {
        let a = b.idx(align);
        b.muli(b.ceildivui(per, a), a)
    } else {
        per
    };
    let start = b.minui(b.muli(d.tid, chunk), total);
    let end = b.minui(b.addi(start, chunk), total);
    (start, end)
}

/// Shares of a kernel's work, in units of `align` items (the last unit may be short: only the
/// range that ends at `total` has a remainder).
///
/// Three quarters of the items are split statically, in contiguous per-thread ranges as
/// [`thread_range`] does (each thread streams its own slice of the weights, no coordination);
/// the last quarter is handed out through the call's work counter, so a thread slowed by the
/// rest of the machine (or simply finishing later) is helped by the others instead of holding
/// everyone at the next barrier. The claimed chunks shrink (guided self-scheduling): each takes
/// `1 / (2 * threads)` of what is left, but at least `min_chunk` items. Early claims are long
/// (few restarts of a thread's weight stream), the last ones short, so threads reach the next
/// barrier within about one short chunk of each other; equal chunks of 256 KiB had left
/// 0.5-0.6 ms of barrier waits per token on the 0.5B shape (half a chunk at every
/// barrier-ending step), and most of the waits of a 135M model. Outputs never depend on which
/// thread computes them, so results stay the same for any thread count or timing.
/// `body(b, start, end)` processes items `start..end`. It is emitted once, inside one loop
/// whose first range is the thread's static share and whose later ranges are claims: a body
/// written twice (static part, then claimed chunks) doubled the code LLVM optimises and
/// generates, most of a cold compile's time.
pub fn split_work<'c, F>(b: Kb<'c, '_>, d: Dyn<'c, '_>, total: usize, align: usize, min_chunk: usize, body: F)
where
    F: for<'x> Fn(Kb<'c, 'x>, Value<'c, 'x>, Value<'c, 'x>),
{
    let units = total.div_ceil(align);
    let static_units = units * 3 / 4;
    let dynamic_units = units - static_units;
    let static_items = (static_units * align).min(total);
    let (own_start, own_end) = if static_items > 0 {
        thread_range(b, b.idx(static_items), d, align)
    } else {
        (b.idx(0), b.idx(0))
    };
    if dynamic_units == 0 {
        return body(b, own_start, own_end);
    }
    let min_units = min_chunk.div_ceil(align).max(1);
    // The end of the chunk starting at unit `s`: s + max(left / (2 nth), min), within bounds.
    fn chunk_end<'c, 'x>(b: Kb<'c, 'x>, d: Dyn<'c, '_>, s: Value<'c, '_>, units: usize, min: usize) -> Value<'c, 'x> {
        let left = b.subi(b.idx(units), s);
        let share = b.divui(left, b.muli(d.nth, b.idx(2)));
        b.minui(b.addi(s, max_index(b, share, b.idx(min))), b.idx(units))
    }
    // Carried: the next range and whether there is one (the static share first, then each
    // claimed chunk).
    b.while_loop(
        &[own_start, own_end, b.idx(1)],
        |b, next| (b.cmpi(Cmp::Ne, next[2], b.idx(0)), vec![next[0], next[1]]),
        |b, range| {
            body(b, range[0], range[1]);
            // Where the next claim starts: the chunk lengths of claims 0..c, summed (each
            // claimant replays the schedule; it is a few integer operations per earlier claim).
            let claim = b.fetch_inc(d.work);
            let lo = b.for_range(b.idx(0), claim, b.idx(1), &[b.idx(0)], |b, _, acc| {
                vec![chunk_end(b, d, acc[0], dynamic_units, min_units)]
            })[0];
            let hi = chunk_end(b, d, lo, dynamic_units, min_units);
            let start = b.addi(b.idx(static_items), b.muli(lo, b.idx(align)));
            let end = b.minui(b.addi(b.idx(static_items), b.muli(hi, b.idx(align))), b.idx(total));
            let more = b.cmpi(Cmp::Ult, lo, b.idx(dynamic_units));
            vec![start, end, b.select(more, b.idx(1), b.idx(0))]
        },
    );
}

/// `max(a, b)` for indices known to be non-negative.
pub fn max_index<'c, 'a>(b: Kb<'c, 'a>, x: Value<'c, '_>, y: Value<'c, '_>) -> Value<'c, 'a> {
    let c = b.cmpi(Cmp::Ugt, x, y);
    b.select(c, x, y)
}
