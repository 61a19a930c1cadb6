//! The Gated DeltaNet kernels (`causal_conv`, `delta_net`, `gated_norm`) against f64
//! references, on calls whose rows mix sequences: one continuing from a saved state, one
//! starting at position 0 in a slot holding another sequence's leftovers (NaN here, so any
//! read of them shows), one at position 1. Each kernel also runs a second call that must
//! continue from the state the first one wrote.

use super::{Rng, TestLib, assert_close, ptr};
use kiln_core::graph::RowInfo;
use kiln_core::{CompileOptions, DType, DecayForm, F32Bits, HeadOrder, HostCpu, Kernel, abi::MAX_SLOTS};

const ROWS: usize = 8;

/// (slot, position) of each row of the first call, and of the second.
const FIRST: [(usize, usize); 6] = [(2, 5), (2, 6), (2, 7), (0, 0), (0, 1), (1, 1)];
const SECOND: [(usize, usize); 3] = [(0, 2), (2, 8), (1, 2)];

fn info(rows: &[(usize, usize)]) -> Vec<i32> {
    rows.iter()
        .flat_map(|&(slot, position)| {
            RowInfo {
                position: position as u32,
                slot: slot as u32,
                seq_end: position as u32 + 1,
            }
            .encode()
        })
        .collect()
}

fn widths() -> Vec<usize> {
    [16, 8, 4]
        .into_iter()
        .filter(|&l| l <= HostCpu::detect().f32_lanes())
        .collect()
}

fn silu(v: f64) -> f64 {
    v / (1.0 + (-v).exp())
}

/// Invariant: each output is `silu(sum_j w[c, j] * x[p - (taps - 1) + j])` over the sequence's
/// own inputs (this call's rows, the saved state, zeros before position 0) whatever the other
/// rows of the call, and each sequence's new state is its last `taps - 1` inputs. Checked with
/// 4 taps over vectors and 3 taps on the scalar path, at every vector width.
#[test]
fn causal_conv_reads_its_own_sequence_and_saves_its_state() {
    for (channels, taps) in [(24, 4), (20, 3)] {
        for lanes in widths() {
            let kernel = |max_rows| Kernel::CausalConv {
                channels,
                taps,
                wdtype: DType::F32,
                max_rows,
            };
            let lib = TestLib::build(&[kernel(ROWS)], &CompileOptions::new(ROWS, lanes), None);
            let mut rng = Rng(7 + channels as u64 + lanes as u64);
            let mut w = rng.vec(channels * taps);
            let keep = (taps - 1) * channels;
            // Every input each slot ever saw, by position (slot 2 has positions 2..5 before).
            let mut seen: Vec<Vec<Vec<f32>>> = vec![Vec::new(); 3];
            let mut state = vec![f32::NAN; MAX_SLOTS * keep];
            seen[2] = (0..5).map(|_| rng.vec(channels)).collect();
            seen[1] = vec![rng.vec(channels)];
            for (i, p) in (5 - (taps - 1)..5).enumerate() {
                state[2 * keep + i * channels..][..channels].copy_from_slice(&seen[2][p]);
            }
            state[keep + (taps - 2) * channels..][..channels].copy_from_slice(&seen[1][0]);
            for call in [&FIRST[..], &SECOND[..]] {
                let rows = call.len();
                let mut x = rng.vec(ROWS * channels);
                for (r, &(slot, p)) in call.iter().enumerate() {
                    assert_eq!(seen[slot].len(), p);
                    seen[slot].push(x[r * channels..][..channels].to_vec());
                }
                let mut out = vec![0f32; ROWS * channels];
                let mut row_info = info(call);
                let ptrs = [
                    ptr(&mut x),
                    ptr(&mut w),
                    ptr(&mut out),
                    ptr(&mut state),
                    ptr(&mut row_info),
                ];
                lib.call(&kernel(ROWS), &ptrs, rows, 2);
                let mut want = Vec::new();
                for &(slot, p) in call {
                    for c in 0..channels {
                        let input = |q: isize| if q < 0 { 0.0 } else { seen[slot][q as usize][c] as f64 };
                        let sum: f64 = (0..taps)
                            .map(|j| w[c * taps + j] as f64 * input(p as isize - (taps - 1 - j) as isize))
                            .sum();
                        want.push(silu(sum));
                    }
                }
                let what = format!("causal_conv c{channels} t{taps} lanes {lanes}");
                assert_close(&out[..rows * channels], &want, 1e-5, &what);
                for &(slot, p) in call {
                    for i in 0..taps - 1 {
                        let q = p as isize - (taps - 2 - i) as isize;
                        let saved = &state[slot * keep + i * channels..][..channels];
                        let want: Vec<f64> = (0..channels)
                            .map(|c| if q < 0 { 0.0 } else { seen[slot][q as usize][c] as f64 })
                            .collect();
                        // The state after the call holds the sequence's last inputs (rows of a
                        // sequence are checked against its final position only).
                        if call.iter().any(|&(s, later)| s == slot && later > p) {
                            continue;
                        }
                        assert_close(saved, &want, 0.0, &format!("{what}: slot {slot} state {i}"));
                    }
                }
            }
        }
    }
}

struct DeltaRef {
    k_heads: usize,
    v_heads: usize,
    k_dim: usize,
    v_dim: usize,
    order: HeadOrder,
}

impl DeltaRef {
    fn key_head(&self, h: usize) -> usize {
        match self.order {
            HeadOrder::Grouped => h / (self.v_heads / self.k_heads),
            HeadOrder::Tiled => h % self.k_heads,
        }
    }

    /// One row of the recurrence in f64, updating `s` (`[v_heads][k_dim][v_dim]`).
    fn step(&self, s: &mut [f64], qkv: &[f32], a: &[f32], b: &[f32], a_neg: &[f64], dt: &[f32]) -> Vec<f64> {
        let (kd, vd) = (self.k_dim, self.v_dim);
        let norm = |x: &[f32]| {
            let inv = 1.0 / (x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() + 1e-6).sqrt();
            x.iter().map(|v| *v as f64 * inv).collect::<Vec<f64>>()
        };
        let mut out = vec![0.0; self.v_heads * vd];
        for h in 0..self.v_heads {
            let kh = self.key_head(h);
            let q: Vec<f64> = norm(&qkv[kh * kd..][..kd])
                .iter()
                .map(|v| v / (kd as f64).sqrt())
                .collect();
            let k = norm(&qkv[(self.k_heads + kh) * kd..][..kd]);
            let v = &qkv[2 * self.k_heads * kd + h * vd..][..vd];
            let x = a[h] as f64 + dt[h] as f64;
            let softplus = if x > 20.0 { x } else { x.exp().ln_1p() };
            let decay = (a_neg[h] * softplus).exp();
            let beta = 1.0 / (1.0 + (-(b[h] as f64)).exp());
            let st = &mut s[h * kd * vd..][..kd * vd];
            st.iter_mut().for_each(|x| *x *= decay);
            for j in 0..vd {
                let kv: f64 = (0..kd).map(|i| st[i * vd + j] * k[i]).sum();
                let delta = (v[j] as f64 - kv) * beta;
                (0..kd).for_each(|i| st[i * vd + j] += k[i] * delta);
                out[h * vd + j] = (0..kd).map(|i| st[i * vd + j] * q[i]).sum();
            }
        }
        out
    }

    /// Where each element of a slot's reference state (`[head][i][j]`) lies in the kernel's
    /// layout, `[head][block of lanes columns][i][lane]`, at `max_lanes`.
    fn kernel_layout(&self, max_lanes: usize) -> Vec<usize> {
        let (kd, vd) = (self.k_dim, self.v_dim);
        let lanes = crate::ir::lanes_for(vd, max_lanes);
        let mut at = Vec::with_capacity(self.v_heads * kd * vd);
        for h in 0..self.v_heads {
            for i in 0..kd {
                for j in 0..vd {
                    at.push(h * kd * vd + (j / lanes) * kd * lanes + i * lanes + j % lanes);
                }
            }
        }
        at
    }
}

/// Invariant: `delta_gates` then `delta_net` compute, row after row, the gated delta rule of `transformers`'
/// recurrent form on each row's own slot state, from a zero state at position 0 (never the
/// slot's leftovers), for both value-head orders and both stored forms of `A`, at every vector
/// width; the state it leaves is the one the next call continues from.
#[test]
fn delta_net_follows_the_recurrence_per_sequence() {
    check_delta_net(ROWS, &[&FIRST, &SECOND]);
}

/// (slot, position) of each row of two prefill calls: runs longer than a chunk that cross a
/// chunk boundary (positions 32 and 64) at different offsets in the call, a sequence starting
/// at 0 over leftovers, one row alone, and continuations from the state the first call left.
fn prefill_calls() -> [Vec<(usize, usize)>; 2] {
    let run = |slot: usize, from: usize, to: usize| (from..to).map(move |p| (slot, p));
    [
        run(2, 5, 45).chain(run(0, 0, 35)).chain(run(1, 1, 2)).collect(),
        run(0, 35, 70).chain(run(2, 45, 50)).chain(run(1, 2, 4)).collect(),
    ]
}

/// Invariant: the prefill kernels' chunked (WY) form computes the same recurrence as the
/// one-token form, to f32 rounding, on calls mixing sequences whose runs cross chunk
/// boundaries, and leaves the state the next call continues from.
#[test]
fn delta_net_chunked_prefill_follows_the_recurrence() {
    let [first, second] = prefill_calls();
    check_delta_net(80, &[&first, &second]);
}

/// Runs `delta_gates` then `delta_net` compiled for `max_rows` over each call in turn,
/// against the f64 recurrence.
fn check_delta_net(max_rows: usize, calls: &[&[(usize, usize)]]) {
    for (order, decay) in [
        (HeadOrder::Grouped, DecayForm::Log),
        (HeadOrder::Tiled, DecayForm::Negated),
    ] {
        // k_dim 16: the eight accumulator chains of `S^T k`; 10: two.
        for (lanes, k_dim) in widths().into_iter().flat_map(|l| [(l, 10), (l, 16)]) {
            let r = DeltaRef {
                k_heads: 2,
                v_heads: 4,
                k_dim,
                v_dim: 24,
                order,
            };
            let gates = Kernel::DeltaGates {
                k_heads: r.k_heads,
                v_heads: r.v_heads,
                k_dim: r.k_dim,
                v_dim: r.v_dim,
                a_dtype: DType::F32,
                dt_dtype: DType::BF16,
                decay,
                max_rows,
            };
            let kernel = Kernel::DeltaNet {
                k_heads: r.k_heads,
                v_heads: r.v_heads,
                k_dim: r.k_dim,
                v_dim: r.v_dim,
                order,
                max_rows,
            };
            let lib = TestLib::build(
                &[gates.clone(), kernel.clone()],
                &CompileOptions::new(max_rows, lanes),
                None,
            );
            let mut rng = Rng(99 + lanes as u64);
            let width = 2 * r.k_heads * r.k_dim + r.v_heads * r.v_dim;
            let per_slot = r.v_heads * r.k_dim * r.v_dim;
            let mut a_param: Vec<f32> = rng.vec(r.v_heads);
            let a_neg: Vec<f64> = match decay {
                DecayForm::Log => a_param.iter().map(|v| -(*v as f64).exp()).collect(),
                DecayForm::Negated => {
                    a_param.iter_mut().for_each(|v| *v = -v.abs() - 0.1);
                    a_param.iter().map(|v| *v as f64).collect()
                }
            };
            let mut dt: Vec<u16> = rng.vec(r.v_heads).iter().map(|v| (v.to_bits() >> 16) as u16).collect();
            let dt_f: Vec<f32> = dt.iter().map(|b| f32::from_bits((*b as u32) << 16)).collect();
            let mut state = vec![f32::NAN; MAX_SLOTS * per_slot];
            let mut refs = vec![vec![0.0f64; per_slot]; 3];
            let layout = r.kernel_layout(lanes);
            for slot in [1, 2] {
                refs[slot] = rng.vec(per_slot).iter().map(|v| *v as f64 * 0.1).collect();
                for (at, v) in layout.iter().zip(&refs[slot]) {
                    state[slot * per_slot + at] = *v as f32;
                }
            }
            for call in calls {
                let rows = call.len();
                let mut qkv = rng.vec(max_rows * width);
                // A spread of gate inputs, one above softplus's threshold.
                let mut a: Vec<f32> = rng.vec(max_rows * r.v_heads).iter().map(|v| v * 4.0).collect();
                a[1] = 25.0;
                let mut b = rng.vec(max_rows * r.v_heads);
                let mut out = vec![0f32; max_rows * r.v_heads * r.v_dim];
                let mut row_info = info(call);
                // The reference reads the raw inputs, which delta_gates rewrites in place.
                let (qkv0, a0, b0) = (qkv.clone(), a.clone(), b.clone());
                let gate_ptrs = [ptr(&mut qkv), ptr(&mut a), ptr(&mut b), ptr(&mut a_param), ptr(&mut dt)];
                lib.call(&gates, &gate_ptrs, rows, 2);
                let ptrs = [
                    ptr(&mut qkv),
                    ptr(&mut a),
                    ptr(&mut b),
                    ptr(&mut out),
                    ptr(&mut state),
                    ptr(&mut row_info),
                ];
                lib.call(&kernel, &ptrs, rows, 2);
                let mut want = Vec::new();
                for (i, &(slot, p)) in call.iter().enumerate() {
                    if p == 0 {
                        refs[slot].iter_mut().for_each(|x| *x = 0.0);
                    }
                    let (av, bv) = (&a0[i * r.v_heads..][..r.v_heads], &b0[i * r.v_heads..][..r.v_heads]);
                    want.extend(r.step(&mut refs[slot], &qkv0[i * width..][..width], av, bv, &a_neg, &dt_f));
                }
                let what = format!("delta_net ({max_rows} rows) {order:?} {decay:?} lanes {lanes} k_dim {k_dim}");
                assert_close(&out[..want.len()], &want, 2e-5, &what);
                for slot in 0..3 {
                    let got: Vec<f32> = layout.iter().map(|at| state[slot * per_slot + at]).collect();
                    assert_close(&got, &refs[slot], 2e-5, &format!("{what} state"));
                }
            }
        }
    }
}

/// Invariant: `gated_norm` is `rmsnorm(x) * w * silu(z)` over each head of each row.
#[test]
fn gated_norm_normalises_each_head_and_gates_it() {
    let (heads, dim) = (3, 24);
    for lanes in widths() {
        let kernel = Kernel::GatedNorm {
            width: heads * dim,
            dim,
            wdtype: DType::F32,
            eps: F32Bits::new(1e-6),
            max_rows: ROWS,
        };
        let lib = TestLib::build(std::slice::from_ref(&kernel), &CompileOptions::new(ROWS, lanes), None);
        let mut rng = Rng(5 + lanes as u64);
        let mut x = rng.vec(ROWS * heads * dim);
        let x0 = x.clone();
        let mut z = rng.vec(ROWS * heads * dim);
        let mut w = rng.vec(dim);
        let rows = 5;
        lib.call(&kernel, &[ptr(&mut x), ptr(&mut z), ptr(&mut w)], rows, 2);
        let mut want = Vec::new();
        for head in x0[..rows * heads * dim].chunks(dim) {
            let ms = head.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / dim as f64;
            let inv = 1.0 / (ms + 1e-6).sqrt();
            want.extend(head.iter().zip(&w).map(|(v, w)| *v as f64 * inv * *w as f64));
        }
        for (v, g) in want.iter_mut().zip(&z) {
            *v *= silu(*g as f64);
        }
        assert_close(&x[..want.len()], &want, 1e-5, &format!("gated_norm lanes {lanes}"));
    }
}
