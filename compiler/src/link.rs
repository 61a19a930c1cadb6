//! Links kernel objects into one shared library with the system C compiler driver.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Drivers tried in order unless `KILN_LINKER` names one.
const DRIVERS: &[&str] = &["cc", "gcc", "clang", "clang-22"];

/// Links `objects` into the shared library `out`. The kernels call `expf`/`cosf`/`sinf`, hence
/// libm.
pub fn link_shared(objects: &[PathBuf], out: &Path) -> Result<(), String> {
    let drivers: Vec<String> = match std::env::var("KILN_LINKER") {
        Ok(d) if !d.is_empty() => vec![d],
        _ => DRIVERS.iter().map(|s| s.to_string()).collect(),
    };
    let mut tried = Vec::new();
    for driver in &drivers {
        let mut cmd = Command::new(driver);
        cmd.arg("-shared").arg("-o").arg(out).args(objects).arg("-lm");
        match cmd.output() {
            Ok(o) if o.status.success() => return Ok(()),
            Ok(o) => {
                return Err(format!(
                    "linking {} with {driver} failed: {}",
                    out.display(),
                    String::from_utf8_lossy(&o.stderr).trim()
                ));
            }
            Err(e) => tried.push(format!("{driver} ({e})")),
        }
    }
    Err(format!(
        "no C linker driver found to link {} (tried {}); install gcc or set KILN_LINKER",
        out.display(),
        tried.join(", ")
    ))
}
