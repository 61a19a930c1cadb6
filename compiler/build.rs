//! Records the LLVM version the compiler links and a hash of the sources that decide the
//! generated code (this crate's and `kiln-core`'s), so both can enter cache keys without calling
//! into LLVM at run time: a library built by older emitters is never taken from the cache, even
//! when nobody remembered to bump `PIPELINE_VERSION`.

use std::process::Command;

fn main() {
    let prefix = std::env::var("MLIR_SYS_220_PREFIX").unwrap_or_else(|_| "/usr/lib/llvm-22".into());
    let config = std::path::Path::new(&prefix).join("bin").join("llvm-config");
    let version = Command::new(&config)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "22-unknown".into());
    println!("cargo:rustc-env=KILN_LLVM_VERSION={version}");
    println!("cargo:rustc-env=KILN_CODEGEN_SOURCE_HASH={:016x}", source_hash());
    println!("cargo:rerun-if-env-changed=MLIR_SYS_220_PREFIX");
    println!("cargo:rerun-if-changed=build.rs");
}

/// FNV-1a over the path and contents of every `.rs` file under `src/` and `../core/src/`,
/// in sorted order (tests included: they cannot change the code, but hashing them is harmless).
fn source_hash() -> u64 {
    let mut files = Vec::new();
    for root in ["src", "../core/src"] {
        println!("cargo:rerun-if-changed={root}");
        collect(std::path::Path::new(root), &mut files);
    }
    files.sort();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for f in files {
        eat(f.to_string_lossy().as_bytes());
        eat(&std::fs::read(&f).unwrap_or_default());
    }
    h
}

fn collect(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}
