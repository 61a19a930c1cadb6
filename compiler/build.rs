//! Records the LLVM version the compiler links, so it can enter cache keys without calling
//! into LLVM at run time.

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
    println!("cargo:rerun-if-env-changed=MLIR_SYS_220_PREFIX");
    println!("cargo:rerun-if-changed=build.rs");
}
