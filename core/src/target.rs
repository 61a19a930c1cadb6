//! What the host CPU offers, read without LLVM.
//!
//! The cache key must be computable without touching MLIR or LLVM (a cache hit never loads the
//! compiler), so the CPU identity comes from the kernel's view of the processor. The compiler
//! separately asks LLVM for the host CPU name and features when it generates code; both describe
//! the same processor, so equal identities here mean equal generated code.

use serde::{Deserialize, Serialize};

/// Identity and capabilities of the host processor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostCpu {
    /// `std::env::consts::ARCH`, e.g. `x86_64`.
    pub arch: String,
    pub vendor: String,
    pub model_name: String,
    /// `family/model/stepping` where the platform reports them.
    pub signature: String,
    /// Feature flags as the kernel reports them, sorted.
    pub features: Vec<String>,
}

impl HostCpu {
    /// Reads `/proc/cpuinfo` (first processor); on platforms without it only the architecture
    /// is known.
    pub fn detect() -> HostCpu {
        // Read once per process: a start asks several times (options, cache key, engine).
        static HOST: std::sync::OnceLock<HostCpu> = std::sync::OnceLock::new();
        HOST.get_or_init(|| {
            let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
            Self::from_cpuinfo(std::env::consts::ARCH, &text)
        })
        .clone()
    }

    /// Parses the first processor block of a `/proc/cpuinfo` text.
    pub fn from_cpuinfo(arch: &str, text: &str) -> HostCpu {
        let block = text.split("\n\n").next().unwrap_or("");
        let field = |name: &str| {
            block
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    (k.trim() == name).then(|| v.trim().to_string())
                })
                .unwrap_or_default()
        };
        let mut features: Vec<String> = {
            let flags = field("flags");
            let flags = if flags.is_empty() { field("Features") } else { flags };
            flags.split_whitespace().map(str::to_string).collect()
        };
        features.sort();
        features.dedup();
        let vendor = [field("vendor_id"), field("CPU implementer")].concat();
        let model_name = [field("model name"), field("CPU part")].concat();
        let signature = format!(
            "{}/{}/{}",
            [field("cpu family"), field("CPU architecture")].concat(),
            [field("model"), field("CPU variant")].concat(),
            [field("stepping"), field("CPU revision")].concat()
        );
        HostCpu {
            arch: arch.to_string(),
            vendor,
            model_name,
            signature,
            features,
        }
    }

    pub fn has(&self, feature: &str) -> bool {
        self.features.binary_search_by(|f| f.as_str().cmp(feature)).is_ok()
    }

    /// The f32 lanes of the widest vector register the kernels should use: 16 with AVX-512,
    /// 8 with AVX/AVX2, 4 otherwise (SSE, NEON).
    pub fn f32_lanes(&self) -> usize {
        if self.arch == "x86_64" && self.has("avx512f") {
            16
        } else if self.arch == "x86_64" && self.has("avx2") && self.has("fma") {
            8
        } else {
            4
        }
    }
}

/// An x86-64 micro-architecture level of the psABI (`x86-64-v2`, `-v3`, `-v4`), which LLVM
/// accepts as a CPU name: a library may be built for one instead of the host CPU, so that a
/// machine with AVX-512 can build, run and check exactly the code an AVX2-only machine (`v3`)
/// gets, registers and instruction selection included, not only its vector width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct X86Level {
    pub name: &'static str,
    /// f32 lanes of the widest vectors the level has.
    pub f32_lanes: usize,
    /// `/proc/cpuinfo` flags the level adds to the one below it.
    pub flags: &'static [&'static str],
}

/// The levels, lowest first; each includes the ones before it.
pub const X86_LEVELS: [X86Level; 3] = [
    X86Level {
        name: "x86-64-v2",
        f32_lanes: 4,
        flags: &["cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"],
    },
    X86Level {
        name: "x86-64-v3",
        f32_lanes: 8,
        flags: &["abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"],
    },
    X86Level {
        name: "x86-64-v4",
        f32_lanes: 16,
        flags: &["avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl"],
    },
];

impl HostCpu {
    /// The level named `name`, if this x86-64 CPU can run code built for it; otherwise an
    /// error naming what is unknown or missing.
    pub fn x86_level(&self, name: &str) -> Result<X86Level, String> {
        let names: Vec<&str> = X86_LEVELS.iter().map(|l| l.name).collect();
        let Some(at) = X86_LEVELS.iter().position(|l| l.name == name) else {
            return Err(format!(
                "unknown target CPU `{name}`: expected one of {}",
                names.join(", ")
            ));
        };
        if self.arch != "x86_64" {
            return Err(format!(
                "target CPU `{name}` is an x86-64 level; this machine is {}",
                self.arch
            ));
        }
        let missing: Vec<&str> = X86_LEVELS[..=at]
            .iter()
            .flat_map(|l| l.flags.iter().copied())
            .filter(|f| !self.has(f))
            .collect();
        if !missing.is_empty() {
            return Err(format!(
                "this CPU cannot run code built for `{name}`: it lacks {}",
                missing.join(", ")
            ));
        }
        Ok(X86_LEVELS[at])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_x86_cpuinfo() {
        let text = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\n\
                    model name\t: AMD EPYC 7B13\nstepping\t: 0\nflags\t\t: fpu sse2 avx2 fma avx\n\n\
                    processor\t: 1\nflags\t\t: other\n";
        let cpu = HostCpu::from_cpuinfo("x86_64", text);
        assert_eq!(cpu.vendor, "AuthenticAMD");
        assert_eq!(cpu.model_name, "AMD EPYC 7B13");
        assert_eq!(cpu.signature, "25/1/0");
        assert_eq!(cpu.features, vec!["avx", "avx2", "fma", "fpu", "sse2"]);
        assert_eq!(cpu.f32_lanes(), 8);
    }

    #[test]
    fn avx512_doubles_the_lanes() {
        let cpu = HostCpu::from_cpuinfo("x86_64", "flags : avx2 fma avx512f\n");
        assert_eq!(cpu.f32_lanes(), 16);
    }

    #[test]
    fn x86_levels_need_their_flags() {
        let v3_flags = "flags : cx16 lahf_lm popcnt sse4_1 sse4_2 ssse3 abm avx avx2 bmi1 bmi2 f16c fma movbe xsave\n";
        let cpu = HostCpu::from_cpuinfo("x86_64", v3_flags);
        assert_eq!(cpu.x86_level("x86-64-v3").unwrap().f32_lanes, 8);
        assert_eq!(cpu.x86_level("x86-64-v2").unwrap().f32_lanes, 4);
        let err = cpu.x86_level("x86-64-v4").unwrap_err();
        assert!(err.contains("lacks avx512bw, avx512cd"), "{err}");
        let err = cpu.x86_level("haswell").unwrap_err();
        assert!(err.contains("unknown target CPU `haswell`"), "{err}");
        let arm = HostCpu::from_cpuinfo("aarch64", "Features : fp asimd\n");
        assert!(arm.x86_level("x86-64-v2").unwrap_err().contains("aarch64"));
    }
}
