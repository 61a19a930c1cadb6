//! Measures this machine's two ceilings with kernels Kiln compiled for it: sequential read
//! bandwidth (decode is judged against it) and f32 FMA throughput (prefill is judged against it),
//! at every thread count from 1 to the number of physical cores.

use crate::buffers::AlignedBuf;
use crate::library::{KernelLibrary, LibraryError};
use crate::pool::{Pool, physical_cores};
use kiln_core::Kernel;
use kiln_core::abi::{PTR_ARGS, WORK_COUNTER_ARG, WORK_COUNTER_BYTES, invoke};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::Instant;

/// One measurement at one thread count.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ProbePoint {
    pub threads: usize,
    /// Best of all passes.
    pub best: f64,
    /// Median of all passes.
    pub median: f64,
}

/// The probe's results, stored per machine next to the cache.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ProbeResult {
    /// Read bandwidth in GB/s (1e9 bytes per second).
    pub read_gb_s: Vec<ProbePoint>,
    /// f32 FMA throughput in GFLOP/s (one FMA = 2 flops).
    pub fma_gflop_s: Vec<ProbePoint>,
    pub buffer_bytes: usize,
    pub passes: usize,
    pub f32_lanes: usize,
    pub unix_time: u64,
    /// Load average when the probe ran (a busy machine reads low).
    pub load_average: Option<f64>,
}

impl ProbeResult {
    /// Best read bandwidth at `threads` (or the closest measured count below it).
    pub fn read_at(&self, threads: usize) -> Option<f64> {
        Self::at(&self.read_gb_s, threads)
    }
    /// Best FMA throughput at `threads`.
    pub fn fma_at(&self, threads: usize) -> Option<f64> {
        Self::at(&self.fma_gflop_s, threads)
    }
    fn at(points: &[ProbePoint], threads: usize) -> Option<f64> {
        points
            .iter()
            .filter(|p| p.threads <= threads)
            .max_by_key(|p| p.threads)
            .map(|p| p.best)
    }
}

/// The probe kernels for a host with `f32_lanes`-wide vectors, reading `buffer_bytes`.
pub fn probe_kernels(buffer_bytes: usize, f32_lanes: usize) -> (Kernel, Kernel) {
    // Enough independent FMA chains to cover latency on two FMA ports, within the register file.
    let chains = if f32_lanes >= 16 { 24 } else { 12 };
    (
        Kernel::ProbeRead {
            elems: buffer_bytes / 4,
        },
        Kernel::ProbeFma { chains },
    )
}

/// Buffer size for the read probe: at least 1 GiB and four times the last-level cache, so the
/// reads come from memory, not cache.
pub fn probe_buffer_bytes() -> usize {
    let llc = (0..8)
        .filter_map(|i| std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu0/cache/index{i}/size")).ok())
        .filter_map(|s| parse_size(s.trim()))
        .max()
        .unwrap_or(0);
    (1usize << 30).max(4 * llc).next_multiple_of(1 << 20)
}

fn parse_size(s: &str) -> Option<usize> {
    let (num, mult) = match s.chars().last()? {
        'K' => (&s[..s.len() - 1], 1 << 10),
        'M' => (&s[..s.len() - 1], 1 << 20),
        'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().ok().map(|n| n * mult)
}

/// The system's one-minute load average.
pub fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// This process's peak resident memory (`VmHWM` of `/proc/self/status`), in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The read probe, kept ready so a benchmark can measure the machine's read bandwidth between
/// its repetitions: on a shared machine the ceiling moves by ±15 % within minutes, so decode is
/// best judged against a ceiling measured in the same run, with the same pool.
pub struct ReadProbe {
    _lib: KernelLibrary,
    read_fn: kiln_core::abi::KernelFn,
    buf: AlignedBuf,
    sums: AlignedBuf,
    /// The ABI's work counter (the probe kernels never claim work from it).
    work: AlignedBuf,
    buffer_bytes: usize,
}

impl ReadProbe {
    /// Binds the read kernel of the probe library at `library` and fills a `buffer_bytes` buffer.
    ///
    /// The buffer lies on transparent huge pages, as a model's weights do (the loader advises
    /// them and pages them in for huge pages): judged against a probe on 4 KiB pages, decode
    /// looked closer to the ceiling than it is. Measured on a 2-core Zen 5 EPYC (2 threads,
    /// best of 5 passes, alternating): in the machine's slow memory phase the probe read
    /// 38-42 GB/s on 4 KiB pages and 44-49 GB/s on huge pages.
    pub fn open(library: &Path, buffer_bytes: usize, f32_lanes: usize) -> Result<ReadProbe, LibraryError> {
        let (read, _) = probe_kernels(buffer_bytes, f32_lanes);
        let lib = KernelLibrary::open(library, std::slice::from_ref(&read))?;
        let read_fn = lib.get(&read).expect("bound");
        let mut buf = AlignedBuf::zeroed_huge(buffer_bytes);
        // Touch every page first so page faults are not measured.
        for (i, v) in buf.f32s_mut(buffer_bytes / 4).iter_mut().enumerate() {
            *v = (i % 1024) as f32 * 1e-3;
        }
        Ok(ReadProbe {
            _lib: lib,
            read_fn,
            buf,
            sums: AlignedBuf::zeroed(64 * 16 * 4),
            work: AlignedBuf::zeroed(WORK_COUNTER_BYTES),
            buffer_bytes,
        })
    }

    /// Best read bandwidth in GB/s over `passes` passes on every thread of `pool`.
    pub fn best_gb_s(&self, pool: &Pool, passes: usize) -> f64 {
        self.measure(pool, passes).best
    }

    /// Read bandwidth in GB/s (best and median of `passes` passes) on every thread of `pool`.
    pub fn measure(&self, pool: &Pool, passes: usize) -> ProbePoint {
        let nth = pool.threads() as i64;
        let (buf_addr, sums_addr) = (self.buf.as_ptr() as usize, self.sums.as_ptr() as usize);
        let work_addr = self.work.as_ptr() as usize;
        let f = self.read_fn;
        let times = measure(passes, || {
            pool.run(&|tid, _| {
                // SAFETY: ABI signature; `buf` holds `elems` f32, `sums` 64 x 16 f32.
                unsafe { invoke(f, slots(&[buf_addr, sums_addr], work_addr), 1, tid as i64, nth) };
            })
        });
        summarise(pool.threads(), &times, |t| self.buffer_bytes as f64 / t / 1e9)
    }
}

/// Runs both probes with the library at `library`, calling `progress` with a line per step.
pub fn run_probe(
    library: &Path,
    buffer_bytes: usize,
    f32_lanes: usize,
    passes: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<ProbeResult, LibraryError> {
    let read_probe = ReadProbe::open(library, buffer_bytes, f32_lanes)?;
    let (_, fma) = probe_kernels(buffer_bytes, f32_lanes);
    let lib = KernelLibrary::open(library, std::slice::from_ref(&fma))?;
    let fma_fn = lib.get(&fma).expect("bound");
    let cores = physical_cores();
    let sums = AlignedBuf::zeroed(64 * 16 * 4);
    let work = AlignedBuf::zeroed(WORK_COUNTER_BYTES);
    // Addresses as integers so the per-thread closures are `Sync`.
    let (sums_addr, work_addr) = (sums.as_ptr() as usize, work.as_ptr() as usize);
    let load_average = load_average();

    let mut read_gb_s = Vec::new();
    let mut fma_gflop_s = Vec::new();
    for threads in 1..=cores.len() {
        let pool = Pool::new(threads, Some(&cores[..threads]));
        let nth = threads as i64;
        let point = read_probe.measure(&pool, passes);
        progress(&format!("read  {threads} thread(s): {:.1} GB/s", point.best));
        read_gb_s.push(point);

        let chains = match fma {
            Kernel::ProbeFma { chains } => chains,
            _ => unreachable!(),
        };
        let iterations: i64 = 20_000_000 / (chains as i64 * f32_lanes as i64 / 64).max(1);
        let flops = iterations as f64 * chains as f64 * f32_lanes as f64 * 2.0 * threads as f64;
        let times = measure(passes, || {
            pool.run(&|tid, _| {
                // SAFETY: ABI signature; `sums` holds 64 x 16 f32.
                unsafe { invoke(fma_fn, slots(&[sums_addr], work_addr), iterations, tid as i64, nth) };
            })
        });
        let point = summarise(threads, &times, |t| flops / t / 1e9);
        progress(&format!("fma   {threads} thread(s): {:.1} GFLOP/s", point.best));
        fma_gflop_s.push(point);
    }
    let unix_time = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(ProbeResult {
        read_gb_s,
        fma_gflop_s,
        buffer_bytes,
        passes,
        f32_lanes,
        unix_time,
        load_average,
    })
}

fn measure(passes: usize, mut f: impl FnMut()) -> Vec<f64> {
    f(); // warm-up
    (0..passes.max(1))
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect()
}

fn summarise(threads: usize, times: &[f64], rate: impl Fn(f64) -> f64) -> ProbePoint {
    let mut rates: Vec<f64> = times.iter().map(|&t| rate(t)).collect();
    rates.sort_by(|a, b| a.total_cmp(b));
    ProbePoint {
        threads,
        best: *rates.last().unwrap(),
        median: rates[rates.len() / 2],
    }
}

/// The ABI's pointer slots: `buffers` (addresses) first, the work counter in its slot, the
/// rest null.
fn slots(buffers: &[usize], work: usize) -> [*mut u8; PTR_ARGS] {
    let mut a = [std::ptr::null_mut(); PTR_ARGS];
    for (slot, &addr) in a.iter_mut().zip(buffers) {
        *slot = addr as *mut u8;
    }
    a[WORK_COUNTER_ARG] = work as *mut u8;
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("266240K"), Some(266240 << 10));
        assert_eq!(parse_size("4M"), Some(4 << 20));
        assert!(probe_buffer_bytes() >= 1 << 30);
    }

    #[test]
    fn lookup_takes_the_closest_lower_thread_count() {
        let p = |threads, best| ProbePoint {
            threads,
            best,
            median: best,
        };
        let r = ProbeResult {
            read_gb_s: vec![p(1, 10.0), p(2, 18.0)],
            fma_gflop_s: vec![p(1, 50.0)],
            buffer_bytes: 0,
            passes: 1,
            f32_lanes: 8,
            unix_time: 0,
            load_average: None,
        };
        assert_eq!(r.read_at(2), Some(18.0));
        assert_eq!(r.read_at(4), Some(18.0));
        assert_eq!(r.fma_at(2), Some(50.0));
    }
}
