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
        let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        Self::from_cpuinfo(std::env::consts::ARCH, &text)
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
}
