//! Structural check that a file is a complete ELF shared object.
//!
//! A linker's exit status is not proof that its output is whole: GNU ld 2.40 exits 0 when the
//! last write of its output fails with ENOSPC, leaving a library that is cut short inside the
//! section header table (seen with the cache on a nearly full tmpfs). Such a file may even load,
//! since the dynamic loader never reads section headers, so it would be published, hashed and
//! trusted. This check reads only the ELF headers and requires every table, section and
//! loadable segment they describe to lie inside the file. It does not look at the code.

/// `\x7fELF`, the first four bytes of every ELF file.
const MAGIC: &[u8; 4] = b"\x7fELF";
/// `e_type` of a shared object (and of a position-independent executable).
const ET_DYN: u16 = 3;
/// `p_type` of a segment the loader maps from the file.
const PT_LOAD: u32 = 1;
/// `sh_type` of an unused section header.
const SHT_NULL: u32 = 0;
/// `sh_type` of a section that occupies no bytes in the file (`.bss`).
const SHT_NOBITS: u32 = 8;

/// Where the fields of the ELF header and of the table entries are, for one ELF class.
struct Layout {
    /// Size of the ELF header.
    header: u64,
    /// Offsets of `e_phoff`, `e_shoff`, `e_phentsize`, `e_phnum`, `e_shentsize`, `e_shnum`.
    phoff: usize,
    shoff: usize,
    phentsize: usize,
    phnum: usize,
    shentsize: usize,
    shnum: usize,
    /// Smallest program and section header entries.
    min_phent: u64,
    min_shent: u64,
    /// Offsets of `p_offset` and `p_filesz` in a program header.
    p_offset: usize,
    p_filesz: usize,
    /// Offsets of `sh_offset` and `sh_size` in a section header.
    sh_offset: usize,
    sh_size: usize,
    /// Width of addresses and offsets: 4 or 8 bytes.
    word: usize,
}

const ELF32: Layout = Layout {
    header: 52,
    phoff: 28,
    shoff: 32,
    phentsize: 42,
    phnum: 44,
    shentsize: 46,
    shnum: 48,
    min_phent: 32,
    min_shent: 40,
    p_offset: 4,
    p_filesz: 16,
    sh_offset: 16,
    sh_size: 20,
    word: 4,
};

const ELF64: Layout = Layout {
    header: 64,
    phoff: 32,
    shoff: 40,
    phentsize: 54,
    phnum: 56,
    shentsize: 58,
    shnum: 60,
    min_phent: 56,
    min_shent: 64,
    p_offset: 8,
    p_filesz: 32,
    sh_offset: 24,
    sh_size: 32,
    word: 8,
};

/// Reads the file's integers in its own byte order; offsets are checked by the caller.
struct Reader<'a> {
    bytes: &'a [u8],
    little: bool,
    layout: &'static Layout,
}

impl Reader<'_> {
    fn uint(&self, at: u64, width: usize) -> u64 {
        let at = at as usize;
        let field = &self.bytes[at..at + width];
        let fold = |acc: u64, byte: &u8| (acc << 8) | u64::from(*byte);
        if self.little {
            field.iter().rev().fold(0, fold)
        } else {
            field.iter().fold(0, fold)
        }
    }

    fn u16(&self, at: usize) -> u64 {
        self.uint(at as u64, 2)
    }

    fn u32(&self, at: u64) -> u32 {
        self.uint(at, 4) as u32
    }

    fn word(&self, at: u64) -> u64 {
        self.uint(at, self.layout.word)
    }
}

/// Checks that `bytes`, the whole content of a file, is a complete ELF shared object: ELF
/// header present and of type `ET_DYN`, program and section header tables inside the file, and
/// every loadable segment and every section with file contents inside the file.
///
/// The error is a reason without the file's name, phrased to follow it ("is not an ELF file",
/// "is truncated: ..."). Never panics, whatever the bytes.
pub(crate) fn check_shared_object(bytes: &[u8]) -> Result<(), String> {
    let len = bytes.len() as u64;
    if bytes.len() < 16 || &bytes[..4] != MAGIC {
        return Err(format!("is not an ELF file ({len} bytes, not starting with \\x7fELF)"));
    }
    let layout = match bytes[4] {
        1 => &ELF32,
        2 => &ELF64,
        class => return Err(format!("has unknown ELF class {class}")),
    };
    let little = match bytes[5] {
        1 => true,
        2 => false,
        order => return Err(format!("has unknown ELF byte order {order}")),
    };
    if len < layout.header {
        return Err(format!(
            "is truncated: its ELF header needs {} bytes, the file has {len}",
            layout.header
        ));
    }
    let elf = Reader { bytes, little, layout };
    let kind = elf.u16(16);
    if kind != u64::from(ET_DYN) {
        return Err(format!(
            "is an ELF file of type {kind}, expected a shared object (type {ET_DYN})"
        ));
    }

    let phoff = elf.word(layout.phoff as u64);
    let phnum = elf.u16(layout.phnum);
    let phent = elf.u16(layout.phentsize);
    if phnum == 0 {
        return Err("has no program headers, so nothing of it can be loaded".to_owned());
    }
    let program_headers = table(len, "program header table", phoff, phnum, phent, layout.min_phent)?;
    for (index, at) in program_headers.enumerate() {
        if elf.u32(at) == PT_LOAD {
            let (offset, size) = (
                elf.word(at + layout.p_offset as u64),
                elf.word(at + layout.p_filesz as u64),
            );
            inside(len, &format!("loadable segment {index}"), offset, size)?;
        }
    }

    let shoff = elf.word(layout.shoff as u64);
    let shent = elf.u16(layout.shentsize);
    if shoff == 0 {
        return Err("has no section header table (a linker always writes one)".to_owned());
    }
    // More than 0xff00 sections: e_shnum is 0 and the count is the first entry's sh_size.
    let mut shnum = elf.u16(layout.shnum);
    if shnum == 0 {
        let mut first = table(len, "section header table", shoff, 1, shent, layout.min_shent)?;
        shnum = first.next().map_or(0, |at| elf.word(at + layout.sh_size as u64));
        if shnum == 0 {
            return Err("has an empty section header table".to_owned());
        }
    }
    let section_headers = table(len, "section header table", shoff, shnum, shent, layout.min_shent)?;
    for (index, at) in section_headers.enumerate() {
        let kind = elf.u32(at + 4);
        if kind != SHT_NULL && kind != SHT_NOBITS {
            let (offset, size) = (
                elf.word(at + layout.sh_offset as u64),
                elf.word(at + layout.sh_size as u64),
            );
            inside(len, &format!("section {index}"), offset, size)?;
        }
    }
    Ok(())
}

/// The offsets of the `count` entries of a table of `entry`-byte entries at `offset`, after
/// checking that entries are at least `min_entry` bytes and the table lies inside the file.
fn table(
    len: u64,
    what: &str,
    offset: u64,
    count: u64,
    entry: u64,
    min_entry: u64,
) -> Result<impl Iterator<Item = u64>, String> {
    if entry < min_entry {
        return Err(format!(
            "has {what} entries of {entry} bytes, expected at least {min_entry}"
        ));
    }
    inside(len, what, offset, count.saturating_mul(entry))?;
    Ok((0..count).map(move |index| offset + index * entry))
}

/// Checks that `size` bytes at `offset` lie inside a file of `len` bytes.
fn inside(len: u64, what: &str, offset: u64, size: u64) -> Result<(), String> {
    match offset.checked_add(size) {
        Some(end) if end <= len => Ok(()),
        Some(end) => Err(format!(
            "is truncated: its {what} ends at byte {end}, past the end of the file ({len} bytes)"
        )),
        None => Err(format!(
            "has a {what} whose offset and size overflow ({offset} + {size})"
        )),
    }
}

#[cfg(test)]
pub(crate) mod tests;
