//! Matmuls over row-grouped weights (`kiln_core::grouped`): fed the grouped copy of a matrix,
//! prefill, decode (one row and batched steps) and decode's fused `gate_up` write bit for bit
//! what the same kernels write from the row-major matrix, for bf16 and f16 weights at every
//! quad-order width and, where the CPU has AVX512-BF16, in `--precision bf16`. Shapes: `k` of
//! several prefill panel chunks, and `n` past one prefill block and not a multiple of it. The
//! embedding gathers the rows of a grouped (tied) token table as it gathers row-major ones.
//! The same from a pair of matrices whose groups alternate (`kiln_core::grouped::GroupPair`,
//! how gate and up are stored): each matrix's matmul read at its own first group, and
//! `gate_up` read from both.

use super::{Rng, TestLib, plain_matmul as matmul, ptr, weights};
use kiln_core::grouped::{PieceOrder, multiplies_in_pairs, pack};
use kiln_core::{Act, CompileOptions, DType, HostCpu, Kernel, Precision};

/// Prefill rows per block: full row tiles and a remainder.
const ROWS: usize = 13;
/// (n, k): whole groups of whole octets, as the spec groups them; `k` of one 16-lane vector
/// and a half (8 lanes, and widened even in `--precision bf16`, whose pairs need whole steps
/// of 32), and past one prefill panel chunk.
const SHAPES: [(usize, usize); 4] = [(48, 96), (48, 4160), (16, 1024), (32, 104)];
const DTYPES: [DType; 2] = [DType::BF16, DType::F16];

/// The matmul over grouped weights, their groups alone or alternating with a partner's.
fn grouped_matmul(n: usize, k: usize, dtype: DType, max_rows: usize, paired: bool) -> Kernel {
    let mut kernel = matmul(n, k, dtype, max_rows, true);
    if let Kernel::MatMul { paired: p, .. } = &mut kernel {
        *p = paired;
    }
    kernel
}

fn gate_up(n: usize, k: usize, dtype: DType, grouped: bool, paired: bool) -> Kernel {
    Kernel::GateUp {
        n,
        k,
        gate_dtype: dtype,
        up_dtype: dtype,
        norm: None,
        act: Act::Silu,
        max_rows: kiln_core::graph::DECODE_ROWS,
        grouped,
        paired,
    }
}

fn suite(precision: Precision) -> Vec<Kernel> {
    let mut ks = Vec::new();
    for (n, k) in SHAPES {
        for dt in DTYPES
            .into_iter()
            .filter(|&d| precision != Precision::Bf16 || d == DType::BF16)
        {
            for max_rows in [ROWS, kiln_core::graph::DECODE_ROWS] {
                ks.push(matmul(n, k, dt, max_rows, false));
                ks.push(grouped_matmul(n, k, dt, max_rows, false));
                ks.push(grouped_matmul(n, k, dt, max_rows, true));
            }
            for (grouped, paired) in [(false, false), (true, false), (true, true)] {
                ks.push(gate_up(n, k, dt, grouped, paired));
            }
        }
    }
    ks
}

/// The widths and precisions this CPU runs: quad order needs 8 lanes or more.
fn configs() -> Vec<(usize, Precision)> {
    let host = HostCpu::detect();
    let mut out: Vec<(usize, Precision)> = [16, 8]
        .into_iter()
        .filter(|&l| l <= host.f32_lanes())
        .map(|l| (l, Precision::Exact))
        .collect();
    if host.f32_lanes() >= 16 && host.features.iter().any(|f| f == "avx512_bf16") {
        out.push((16, Precision::Bf16));
    }
    out
}

/// Calls `kernel` on a copy of `x` and the weights at `ws` (one matrix, or gate and up; the
/// kernels only read them) for `rows` rows, returning the bits of its `ys` outputs.
fn run(lib: &TestLib, kernel: &Kernel, x: &[f32], ws: &[*mut u8], ys: usize, n: usize, rows: usize) -> Vec<u32> {
    let mut x = x.to_vec();
    let mut outs: Vec<Vec<f32>> = (0..ys).map(|_| vec![0f32; ROWS * n]).collect();
    let mut args = vec![ptr(&mut x)];
    for (w, o) in ws.iter().zip(outs.iter_mut()) {
        args.push(*w);
        args.push(ptr(o));
    }
    lib.call(kernel, &args, rows, 2);
    outs.iter()
        .flat_map(|o| o[..rows * n].iter().map(|v| v.to_bits()))
        .collect()
}

#[test]
fn grouped_weights_give_the_row_major_bits() {
    for (lanes, precision) in configs() {
        let options = CompileOptions {
            precision,
            ..CompileOptions::new(ROWS, lanes)
        };
        let lib = TestLib::build(&suite(precision), &options, None);
        let mut rng = Rng(0x960a + lanes as u64);
        for (n, k) in SHAPES {
            for dt in DTYPES
                .into_iter()
                .filter(|&d| precision != Precision::Bf16 || d == DType::BF16)
            {
                let what = format!("{dt} n {n} k {k}, {lanes} lanes, {precision:?}");
                let x = rng.vec(ROWS * k);
                let (mut wg, _) = weights(&mut rng, n * k, dt);
                let (mut wu, _) = weights(&mut rng, n * k, dt);
                let order = PieceOrder::for_weights(dt, multiplies_in_pairs(dt, k, lanes, precision));
                let order = order.expect("bf16 and f16 have row groups");
                let packed = |ws: &[&[u8]]| {
                    let mut p = vec![0u8; ws[0].len() * ws.len()];
                    pack(order, ws, &mut p, k);
                    p
                };
                let (mut pg, mut pu, mut pair) = (packed(&[&wg]), packed(&[&wu]), packed(&[&wg, &wu]));
                // The up matrix's first group is one group into the pair.
                let (gate_in_pair, up_in_pair) = (ptr(&mut pair), ptr(&mut pair).wrapping_add(16 * k * 2));
                let (plain, alone) = ((ptr(&mut wg), ptr(&mut wu)), (ptr(&mut pg), ptr(&mut pu)));
                for (max_rows, rows) in [(ROWS, ROWS), (ROWS, 5), (8, 1), (8, 5)] {
                    let row_major = matmul(n, k, dt, max_rows, false);
                    let (single, paired) = (
                        grouped_matmul(n, k, dt, max_rows, false),
                        grouped_matmul(n, k, dt, max_rows, true),
                    );
                    for (w, alone, in_pair) in [(plain.0, alone.0, gate_in_pair), (plain.1, alone.1, up_in_pair)] {
                        let want = run(&lib, &row_major, &x, &[w], 1, n, rows);
                        let got = run(&lib, &single, &x, &[alone], 1, n, rows);
                        assert_eq!(got, want, "{what}: matmul of {rows} rows (block {max_rows})");
                        let got = run(&lib, &paired, &x, &[in_pair], 1, n, rows);
                        assert_eq!(got, want, "{what}: paired matmul of {rows} rows (block {max_rows})");
                    }
                }
                for rows in [1, 5] {
                    let want = run(
                        &lib,
                        &gate_up(n, k, dt, false, false),
                        &x,
                        &[plain.0, plain.1],
                        2,
                        n,
                        rows,
                    );
                    let got = run(
                        &lib,
                        &gate_up(n, k, dt, true, false),
                        &x,
                        &[alone.0, alone.1],
                        2,
                        n,
                        rows,
                    );
                    assert_eq!(got, want, "{what}: gate_up of {rows} rows");
                    let pair = [gate_in_pair, up_in_pair];
                    let got = run(&lib, &gate_up(n, k, dt, true, true), &x, &pair, 2, n, rows);
                    assert_eq!(got, want, "{what}: paired gate_up of {rows} rows");
                }
            }
        }
    }
}

fn embed(vocab: usize, hidden: usize, dtype: DType, grouped: Option<PieceOrder>) -> Kernel {
    Kernel::Embed {
        vocab,
        hidden,
        dtype,
        scale: None,
        positions: None,
        max_rows: ROWS,
        grouped,
    }
}

/// Every piece order, fed its packed copy of a table: the embedding writes the rows the plain
/// gather writes from the row-major table, for tokens in every place of a group (first, last,
/// each quarter) and the last row of the table.
#[test]
fn grouped_tables_gather_the_row_major_rows() {
    const VOCAB: usize = 48;
    const HIDDEN: usize = 104;
    let cases = [
        (DType::BF16, PieceOrder::Widen),
        (DType::BF16, PieceOrder::Pairs),
        (DType::F16, PieceOrder::Quads),
    ];
    let mut kernels: Vec<Kernel> = cases.iter().map(|&(dt, o)| embed(VOCAB, HIDDEN, dt, Some(o))).collect();
    kernels.extend(DTYPES.map(|dt| embed(VOCAB, HIDDEN, dt, None)));
    let lanes = HostCpu::detect().f32_lanes();
    let lib = TestLib::build(&kernels, &CompileOptions::new(ROWS, lanes), None);
    let mut rng = Rng(0xe3b3);
    let tokens: Vec<i32> = vec![0, 15, 17, 22, 47, 36, 5, 30, 40, 1, 46, 11, 29];
    for (dt, order) in cases {
        let (table, _) = weights(&mut rng, VOCAB * HIDDEN, dt);
        let mut packed = vec![0u8; table.len()];
        pack(order, &[&table], &mut packed, HIDDEN);
        assert_ne!(packed, table, "{order:?} moves bytes");
        let gather = |kernel: &Kernel, table: &[u8]| {
            let (mut t, mut w) = (tokens.clone(), table.to_vec());
            let mut x = vec![f32::NAN; ROWS * HIDDEN];
            lib.call(kernel, &[ptr(&mut t), ptr(&mut w), ptr(&mut x)], ROWS, 2);
            x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
        };
        let want = gather(&embed(VOCAB, HIDDEN, dt, None), &table);
        let got = gather(&embed(VOCAB, HIDDEN, dt, Some(order)), &packed);
        assert_eq!(got, want, "{dt} table in {order:?} order");
    }
}
