//! Tests of the ELF completeness check: complete files pass, and every way a file can be cut
//! short or describe bytes it does not have is rejected with a reason, never a panic.

use super::{ELF32, ELF64, Layout, check_shared_object};

/// One of the four ELF flavours: 32 or 64 bits, little or big endian.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Flavour {
    pub(crate) bits64: bool,
    pub(crate) little: bool,
}

pub(crate) const FLAVOURS: [Flavour; 4] = [
    Flavour {
        bits64: true,
        little: true,
    },
    Flavour {
        bits64: true,
        little: false,
    },
    Flavour {
        bits64: false,
        little: true,
    },
    Flavour {
        bits64: false,
        little: false,
    },
];

impl Flavour {
    fn layout(self) -> &'static Layout {
        if self.bits64 { &ELF64 } else { &ELF32 }
    }

    /// Writes `value` as `width` bytes at `at`, in this flavour's byte order.
    pub(crate) fn put(self, bytes: &mut [u8], at: usize, width: usize, value: u64) {
        for i in 0..width {
            let byte = (value >> (8 * i)) as u8;
            let index = if self.little { at + i } else { at + width - 1 - i };
            bytes[index] = byte;
        }
    }

    fn put_word(self, bytes: &mut [u8], at: usize, value: u64) {
        self.put(bytes, at, self.layout().word, value);
    }
}

/// Where the parts of [`shared_object`]'s file are.
pub(crate) struct Parts {
    pub(crate) bytes: Vec<u8>,
    /// Offset of the program header (one `PT_LOAD`).
    pub(crate) phdr: usize,
    /// Offset of the section header table (null, `.text`, `.bss`, `.shstrtab`), the last thing
    /// in the file, as GNU ld lays it out.
    pub(crate) shdrs: usize,
}

/// A small, complete ELF shared object as a linker lays it out: header, program header table,
/// `.text`, `.shstrtab`, then the section header table at the very end. `.bss` has no bytes in
/// the file and an offset and size that reach past its end, as real ones may.
pub(crate) fn shared_object(flavour: Flavour) -> Parts {
    let layout = flavour.layout();
    let (header, phent, shent) = (
        layout.header as usize,
        layout.min_phent as usize,
        layout.min_shent as usize,
    );
    let phdr = header;
    let text = phdr + phent;
    let text_len = 24;
    let names = b"\0.text\0.bss\0.shstrtab\0";
    let strtab = text + text_len;
    let shdrs = (strtab + names.len()).next_multiple_of(8);
    let len = shdrs + 4 * shent;
    let mut b = vec![0u8; len];
    b[..4].copy_from_slice(b"\x7fELF");
    b[4] = if flavour.bits64 { 2 } else { 1 };
    b[5] = if flavour.little { 1 } else { 2 };
    b[6] = 1;
    let f = flavour;
    f.put(&mut b, 16, 2, 3); // ET_DYN
    f.put(&mut b, 18, 2, 62);
    f.put(&mut b, 20, 4, 1);
    f.put_word(&mut b, layout.phoff, phdr as u64);
    f.put_word(&mut b, layout.shoff, shdrs as u64);
    f.put(&mut b, layout.phentsize - 2, 2, header as u64); // e_ehsize
    f.put(&mut b, layout.phentsize, 2, phent as u64);
    f.put(&mut b, layout.phnum, 2, 1);
    f.put(&mut b, layout.shentsize, 2, shent as u64);
    f.put(&mut b, layout.shnum, 2, 4);
    f.put(&mut b, layout.shnum + 2, 2, 3); // e_shstrndx

    f.put(&mut b, phdr, 4, 1); // PT_LOAD of everything up to the end of .text
    f.put_word(&mut b, phdr + layout.p_offset, 0);
    f.put_word(&mut b, phdr + layout.p_filesz, (text + text_len) as u64);
    b[text..text + text_len].fill(0xc3);
    b[strtab..strtab + names.len()].copy_from_slice(names);

    // (name, type, offset, size) of sections 1..=3; section 0 stays null.
    let sections = [
        (1, 1, text, text_len),
        (7, 8, strtab, 1 << 20),
        (12, 3, strtab, names.len()),
    ];
    for (index, (name, kind, offset, size)) in sections.into_iter().enumerate() {
        let at = shdrs + (index + 1) * shent;
        f.put(&mut b, at, 4, name);
        f.put(&mut b, at + 4, 4, kind);
        f.put_word(&mut b, at + layout.sh_offset, offset as u64);
        f.put_word(&mut b, at + layout.sh_size, size as u64);
    }
    Parts { bytes: b, phdr, shdrs }
}

fn rejected(bytes: &[u8]) -> String {
    check_shared_object(bytes).expect_err("a damaged file must be rejected")
}

/// The invariant everything else relies on: the synthetic files are complete, in every flavour,
/// including a `.bss` whose offset and size reach past the end of the file.
#[test]
fn complete_shared_objects_pass_in_every_class_and_byte_order() {
    for flavour in FLAVOURS {
        let parts = shared_object(flavour);
        assert_eq!(check_shared_object(&parts.bytes), Ok(()), "{flavour:?}");
    }
}

/// Truncation anywhere (ld's lost ENOSPC cut the section header table) is caught.
#[test]
fn every_truncation_is_rejected() {
    for flavour in FLAVOURS {
        let bytes = shared_object(flavour).bytes;
        for cut in 0..bytes.len() {
            let reason = rejected(&bytes[..cut]);
            assert!(
                reason.starts_with("is truncated") || reason.starts_with("is not an ELF file"),
                "{flavour:?} cut at {cut}: {reason}"
            );
        }
    }
}

#[test]
fn a_cut_inside_the_section_header_table_names_it() {
    let parts = shared_object(FLAVOURS[0]);
    let (full, cut) = (parts.bytes.len(), parts.bytes.len() - 40);
    let reason = rejected(&parts.bytes[..cut]);
    assert_eq!(
        reason,
        format!("is truncated: its section header table ends at byte {full}, past the end of the file ({cut} bytes)")
    );
}

#[test]
fn a_section_header_table_placed_past_the_end_is_rejected() {
    let flavour = FLAVOURS[0];
    let mut parts = shared_object(flavour);
    flavour.put_word(&mut parts.bytes, ELF64.shoff, parts.shdrs as u64 + 1);
    let reason = rejected(&parts.bytes);
    assert!(reason.contains("section header table ends at byte"), "{reason}");
    assert!(reason.contains("past the end of the file"), "{reason}");

    // No table at all.
    flavour.put_word(&mut parts.bytes, ELF64.shoff, 0);
    assert!(rejected(&parts.bytes).contains("no section header table"));
}

#[test]
fn not_an_elf_file_is_rejected() {
    for bytes in [&b""[..], b"\x7fELF", b"#!/bin/sh\necho not a library\n", &[0u8; 4096]] {
        let reason = rejected(bytes);
        assert!(reason.starts_with("is not an ELF file"), "{reason}");
        assert!(reason.contains(&format!("({} bytes", bytes.len())), "{reason}");
    }
    let mut bytes = shared_object(FLAVOURS[0]).bytes;
    bytes[4] = 3;
    assert_eq!(rejected(&bytes), "has unknown ELF class 3");
    bytes[4] = 2;
    bytes[5] = 0;
    assert_eq!(rejected(&bytes), "has unknown ELF byte order 0");
}

#[test]
fn executables_and_objects_are_not_shared_objects() {
    for (kind, name) in [(1, "relocatable"), (2, "executable")] {
        let flavour = FLAVOURS[1];
        let mut bytes = shared_object(flavour).bytes;
        flavour.put(&mut bytes, 16, 2, kind);
        assert_eq!(
            rejected(&bytes),
            format!("is an ELF file of type {kind}, expected a shared object (type 3)"),
            "{name}"
        );
    }
}

#[test]
fn sections_and_segments_past_the_end_are_rejected() {
    for flavour in FLAVOURS {
        let layout = flavour.layout();
        let parts = shared_object(flavour);
        let len = parts.bytes.len() as u64;

        let mut bytes = parts.bytes.clone();
        flavour.put_word(&mut bytes, parts.phdr + layout.p_filesz, len + 1);
        assert!(
            rejected(&bytes).contains("loadable segment 0 ends at byte"),
            "{flavour:?}"
        );

        let mut bytes = parts.bytes.clone();
        let text = parts.shdrs + layout.min_shent as usize;
        flavour.put_word(&mut bytes, text + layout.sh_offset, len - 1);
        assert_eq!(
            rejected(&bytes),
            format!(
                "is truncated: its section 1 ends at byte {}, past the end of the file ({len} bytes)",
                len - 1 + 24
            ),
            "{flavour:?}"
        );

        let mut bytes = parts.bytes.clone();
        flavour.put(&mut bytes, layout.phnum, 2, 0);
        assert!(rejected(&bytes).contains("no program headers"), "{flavour:?}");
    }
}

#[test]
fn entry_sizes_below_the_minimum_are_rejected() {
    let flavour = FLAVOURS[0];
    let mut bytes = shared_object(flavour).bytes;
    flavour.put(&mut bytes, ELF64.shentsize, 2, 8);
    assert_eq!(
        rejected(&bytes),
        "has section header table entries of 8 bytes, expected at least 64"
    );
}

#[test]
fn overflowing_offsets_and_counts_are_rejected_without_panic() {
    let flavour = FLAVOURS[0];
    let parts = shared_object(flavour);
    for (field, value) in [(ELF64.shoff, u64::MAX - 10), (ELF64.phoff, u64::MAX)] {
        let mut bytes = parts.bytes.clone();
        flavour.put_word(&mut bytes, field, value);
        let reason = rejected(&bytes);
        assert!(reason.contains("overflow"), "{reason}");
    }
    let mut bytes = parts.bytes.clone();
    flavour.put(&mut bytes, ELF64.shnum, 2, 0);
    flavour.put_word(&mut bytes, parts.shdrs + ELF64.sh_size, u64::MAX);
    assert!(rejected(&bytes).contains("overflow"));
}

/// With more than 0xff00 sections `e_shnum` is 0 and the first entry's `sh_size` is the count.
#[test]
fn a_section_count_in_the_first_entry_is_honoured() {
    let flavour = FLAVOURS[2];
    let layout = flavour.layout();
    let parts = shared_object(flavour);
    let mut bytes = parts.bytes.clone();
    flavour.put(&mut bytes, layout.shnum, 2, 0);
    flavour.put_word(&mut bytes, parts.shdrs + layout.sh_size, 4);
    assert_eq!(check_shared_object(&bytes), Ok(()));
    flavour.put_word(&mut bytes, parts.shdrs + layout.sh_size, 5);
    assert!(rejected(&bytes).contains("section header table ends at byte"));
    flavour.put_word(&mut bytes, parts.shdrs + layout.sh_size, 0);
    assert_eq!(rejected(&bytes), "has an empty section header table");
}

/// Whatever byte of the headers is damaged, the check answers instead of panicking.
#[test]
fn any_damaged_header_byte_gives_an_answer() {
    for flavour in FLAVOURS {
        let parts = shared_object(flavour);
        let header_bytes = (0..parts.phdr + 64).chain(parts.shdrs..parts.bytes.len());
        for at in header_bytes {
            for value in [0x00, 0x7f, 0xff] {
                let mut bytes = parts.bytes.clone();
                bytes[at] = value;
                let _ = check_shared_object(&bytes);
            }
        }
    }
}

/// A shared object made by a real linker (the C library this test runs with) passes whole and
/// is rejected cut at any of several points, the one of the ENOSPC report (592 bytes short)
/// included.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn a_real_shared_object_passes_whole_and_fails_cut() {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let libc = maps
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| path.contains("/libc.so"))
        .expect("this test process maps the C library");
    let bytes = std::fs::read(libc).unwrap();
    assert_eq!(check_shared_object(&bytes), Ok(()), "{libc}");
    let len = bytes.len();
    for cut in [len - 1, len - 592, len * 99 / 100, len / 2, 4096, 64, 16] {
        let reason = rejected(&bytes[..cut]);
        assert!(reason.starts_with("is truncated"), "{libc} cut at {cut}: {reason}");
    }
}
