//! Links kernel objects into one shared library with the system C compiler driver.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Drivers tried in order unless `KILN_LINKER` names one.
const DRIVERS: &[&str] = &["cc", "gcc", "clang", "clang-22"];

/// Links `objects` into the shared library `out`. The kernels call `expf`/`cosf`/`sinf`, hence
/// libm. The linker runs in the C locale so that its messages (e.g. "No space left on device")
/// read the same everywhere; its exit status alone is not trusted (see [`check_output`]).
pub fn link_shared(objects: &[PathBuf], out: &Path) -> Result<(), String> {
    let drivers: Vec<String> = match std::env::var("KILN_LINKER") {
        Ok(d) if !d.is_empty() => vec![d],
        _ => DRIVERS.iter().map(|s| s.to_string()).collect(),
    };
    let mut tried = Vec::new();
    for driver in &drivers {
        let mut cmd = Command::new(driver);
        cmd.arg("-shared").arg("-o").arg(out).args(objects).arg("-lm");
        cmd.env("LC_ALL", "C");
        match cmd.output() {
            Ok(o) if o.status.success() => {
                return check_output(out).map_err(|e| format!("linking {} with {driver}: {e}", out.display()));
            }
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

/// Checks that the linker really wrote all of `out`.
///
/// GNU ld 2.40 exits 0 when the last write of its output fails with ENOSPC (seen on a nearly
/// full tmpfs: 94,208 of 94,800 bytes), and some file systems report write errors only when the
/// data is synced. So the output is synced here, and its size compared with where its ELF header
/// says the section header table, which ld writes last, ends. A file cut short is completed
/// with the missing bytes as a probe: the file system's refusal is the error the linker lost.
/// (The cache checks the whole ELF structure again before publishing; this check is here to
/// name the cause while the linker's objects still fill the disk.)
fn check_output(out: &Path) -> Result<(), String> {
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(out)
        .map_err(|e| format!("cannot open the output: {e}"))?;
    file.sync_all().map_err(|e| format!("cannot sync the output: {e}"))?;
    let len = file
        .metadata()
        .map_err(|e| format!("cannot inspect the output: {e}"))?
        .len();
    let Some(end) = section_headers_end(&mut file) else {
        // Not a 64-bit little-endian ELF file: left to the cache's complete check.
        return Ok(());
    };
    if len >= end {
        return Ok(());
    }
    let probe = file
        .seek(SeekFrom::Start(len))
        .and_then(|_| file.write_all(&vec![0; (end - len) as usize]))
        .and_then(|()| file.sync_all());
    let cause = match probe {
        Err(e) => e.to_string(),
        Ok(()) => "its write was cut short".to_string(),
    };
    Err(format!(
        "the linker exited 0 but wrote {len} of the {end} bytes its ELF header describes: {cause}"
    ))
}

/// Where the section header table of a 64-bit little-endian ELF file ends (`e_shoff +
/// e_shnum * e_shentsize`), or `None` for any other file.
fn section_headers_end(file: &mut File) -> Option<u64> {
    let mut header = [0u8; 64];
    file.seek(SeekFrom::Start(0)).ok()?;
    file.read_exact(&mut header).ok()?;
    if &header[..4] != b"\x7fELF" || header[4] != 2 || header[5] != 1 {
        return None;
    }
    let shoff = u64::from_le_bytes(header[40..48].try_into().ok()?);
    let shentsize = u64::from(u16::from_le_bytes([header[58], header[59]]));
    let shnum = u64::from(u16::from_le_bytes([header[60], header[61]]));
    shoff.checked_add(shentsize.checked_mul(shnum)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake ELF header whose section header table (27 entries of 64 bytes at 93,072) ends at
    /// byte 94,800, like the fixture library's.
    fn elf_header() -> Vec<u8> {
        let mut header = vec![0u8; 64];
        header[..6].copy_from_slice(b"\x7fELF\x02\x01");
        header[40..48].copy_from_slice(&93_072u64.to_le_bytes());
        header[58..60].copy_from_slice(&64u16.to_le_bytes());
        header[60..62].copy_from_slice(&27u16.to_le_bytes());
        header
    }

    /// The linker's lost ENOSPC: an output shorter than its header says is an error that says
    /// how much was written, and a whole one passes.
    #[test]
    fn an_output_shorter_than_its_section_headers_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("libkiln.so");
        let mut bytes = elf_header();
        bytes.resize(94_208, 0);
        std::fs::write(&out, &bytes).unwrap();
        let err = check_output(&out).unwrap_err();
        // Here the missing bytes can be written, so the cause is not the file system's.
        assert_eq!(
            err,
            "the linker exited 0 but wrote 94208 of the 94800 bytes its ELF header describes: its write was cut short"
        );

        bytes.resize(94_800, 0);
        std::fs::write(&out, &bytes).unwrap();
        assert_eq!(check_output(&out), Ok(()));
    }

    /// Outputs the check cannot read are left to the cache's check instead of refused.
    #[test]
    fn other_files_are_not_judged_here() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("libkiln.so");
        for bytes in [&b"not an ELF file"[..], &[0x7f, b'E', b'L', b'F', 1, 1, 0, 0]] {
            std::fs::write(&out, bytes).unwrap();
            assert_eq!(check_output(&out), Ok(()));
        }
        let err = check_output(&dir.path().join("missing.so")).unwrap_err();
        assert!(err.starts_with("cannot open the output: "), "{err}");
    }
}
