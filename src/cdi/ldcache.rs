//! Reads glibc's `/etc/ld.so.cache` (the `glibc-ld.so.cache1.1` format, alone or after the old `ld.so-1.7.0`
//! table as glibc < 2.32 wrote it) into soname / path pairs, so that driver libraries in directories only the
//! host's linker configuration names are found too.

const OLD_MAGIC: &[u8] = b"ld.so-1.7.0";
const NEW_MAGIC: &[u8] = b"glibc-ld.so.cache1.1";
/// Old header: 11-byte magic padded to 12, `nlibs`; entries: flags, key, value.
const OLD_HEADER: usize = 16;
const OLD_ENTRY: usize = 12;
/// New header: magic and version (20), nlibs, len_strings, 20 bytes of flags / extension offset / unused;
/// entries: flags, key, value, osversion, hwcap (u64).
const NEW_HEADER: usize = 48;
const NEW_ENTRY: usize = 24;

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct CacheEntry {
    pub flags: i32,
    /// The name the linker looks up, e.g. `libcuda.so.1`.
    pub soname: String,
    /// Where the host's linker finds it, an absolute path on the host.
    pub path: String,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(super) enum LdCacheError {
    #[error("not an ld.so.cache (no known magic)")]
    UnknownFormat,
    #[error("truncated: {what} ends past the {len}-byte file")]
    Truncated { what: &'static str, len: usize },
}

/// All entries of a cache file, in file order; entries whose strings are not UTF-8 are left out.
pub(super) fn parse(data: &[u8]) -> Result<Vec<CacheEntry>, LdCacheError> {
    if data.starts_with(NEW_MAGIC) {
        return parse_new(data, 0);
    }
    if !data.starts_with(OLD_MAGIC) {
        return Err(LdCacheError::UnknownFormat);
    }
    let truncated = |what| LdCacheError::Truncated {
        what,
        len: data.len(),
    };
    let nlibs = read_u32(data, 12).ok_or_else(|| truncated("the old header"))? as usize;
    let strings = nlibs
        .checked_mul(OLD_ENTRY)
        .and_then(|n| n.checked_add(OLD_HEADER))
        .filter(|&end| end <= data.len())
        .ok_or_else(|| truncated("the old entry table"))?;
    // glibc 2.2 to 2.31 put the new table right after the old one, aligned for its u64 fields; the new
    // table is the one the linker reads when both are present.
    let new_start = strings.next_multiple_of(8);
    if data
        .get(new_start..)
        .is_some_and(|rest| rest.starts_with(NEW_MAGIC))
    {
        return parse_new(data, new_start);
    }
    let mut entries = Vec::with_capacity(nlibs);
    for i in 0..nlibs {
        let at = OLD_HEADER + i * OLD_ENTRY;
        let (Some(flags), Some(key), Some(value)) = (
            read_u32(data, at),
            read_u32(data, at + 4),
            read_u32(data, at + 8),
        ) else {
            return Err(truncated("an old entry"));
        };
        // Old string offsets count from the end of the old entry table.
        push_entry(&mut entries, data, strings, flags as i32, key, value)?;
    }
    Ok(entries)
}

fn parse_new(data: &[u8], base: usize) -> Result<Vec<CacheEntry>, LdCacheError> {
    let truncated = |what| LdCacheError::Truncated {
        what,
        len: data.len(),
    };
    let nlibs = read_u32(data, base + 20).ok_or_else(|| truncated("the new header"))? as usize;
    nlibs
        .checked_mul(NEW_ENTRY)
        .and_then(|n| n.checked_add(base + NEW_HEADER))
        .filter(|&end| end <= data.len())
        .ok_or_else(|| truncated("the new entry table"))?;
    let mut entries = Vec::with_capacity(nlibs);
    for i in 0..nlibs {
        let at = base + NEW_HEADER + i * NEW_ENTRY;
        let (Some(flags), Some(key), Some(value)) = (
            read_u32(data, at),
            read_u32(data, at + 4),
            read_u32(data, at + 8),
        ) else {
            return Err(truncated("a new entry"));
        };
        // New string offsets count from the start of the new header.
        push_entry(&mut entries, data, base, flags as i32, key, value)?;
    }
    Ok(entries)
}

fn push_entry(
    entries: &mut Vec<CacheEntry>,
    data: &[u8],
    strings: usize,
    flags: i32,
    key: u32,
    value: u32,
) -> Result<(), LdCacheError> {
    let string = |offset: u32| -> Result<Option<String>, LdCacheError> {
        let start = strings
            .checked_add(offset as usize)
            .filter(|&s| s < data.len())
            .ok_or(LdCacheError::Truncated {
                what: "a string offset",
                len: data.len(),
            })?;
        let rest = &data[start..];
        let end = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or(LdCacheError::Truncated {
                what: "a string",
                len: data.len(),
            })?;
        Ok(std::str::from_utf8(&rest[..end]).ok().map(str::to_owned))
    };
    if let (Some(soname), Some(path)) = (string(key)?, string(value)?) {
        entries.push(CacheEntry {
            flags,
            soname,
            path,
        });
    }
    Ok(())
}

/// The cache is written by the host's own ldconfig, so it is in this machine's byte order.
fn read_u32(data: &[u8], at: usize) -> Option<u32> {
    let bytes = data.get(at..at.checked_add(4)?)?;
    Some(u32::from_ne_bytes(bytes.try_into().ok()?))
}

/// Builds cache files the way ldconfig lays them out, for tests here and in `host_driver`.
#[cfg(test)]
pub(super) mod build {
    /// A new-format cache, alone (`with_old_table == false`, glibc >= 2.32) or after an old table
    /// holding the same entries (the compat layout of glibc 2.2 to 2.31).
    pub fn cache(entries: &[(i32, &str, &str)], with_old_table: bool) -> Vec<u8> {
        let mut new = Vec::new();
        new.extend_from_slice(super::NEW_MAGIC);
        new.extend_from_slice(&(entries.len() as u32).to_ne_bytes());
        let strings_at = super::NEW_HEADER + entries.len() * super::NEW_ENTRY;
        let mut strings = Vec::new();
        let mut offsets = Vec::new();
        for (_, key, value) in entries {
            let k = strings_at + strings.len();
            strings.extend_from_slice(key.as_bytes());
            strings.push(0);
            let v = strings_at + strings.len();
            strings.extend_from_slice(value.as_bytes());
            strings.push(0);
            offsets.push((k as u32, v as u32));
        }
        new.extend_from_slice(&(strings.len() as u32).to_ne_bytes());
        new.extend_from_slice(&[0; 20]);
        for ((flags, _, _), (k, v)) in entries.iter().zip(&offsets) {
            new.extend_from_slice(&flags.to_ne_bytes());
            new.extend_from_slice(&k.to_ne_bytes());
            new.extend_from_slice(&v.to_ne_bytes());
            new.extend_from_slice(&0u32.to_ne_bytes());
            new.extend_from_slice(&0u64.to_ne_bytes());
        }
        new.extend_from_slice(&strings);
        if !with_old_table {
            return new;
        }
        let old_end = super::OLD_HEADER + entries.len() * super::OLD_ENTRY;
        let pad = old_end.next_multiple_of(8) - old_end;
        let mut out = old_table(entries, &offsets, pad);
        out.extend_from_slice(&new);
        out
    }

    /// An old-format cache only (libc5 / glibc < 2.2), with its strings after the entry table.
    pub fn old_only(entries: &[(i32, &str, &str)]) -> Vec<u8> {
        let mut strings = Vec::new();
        let mut offsets = Vec::new();
        for (_, key, value) in entries {
            let k = strings.len() as u32;
            strings.extend_from_slice(key.as_bytes());
            strings.push(0);
            let v = strings.len() as u32;
            strings.extend_from_slice(value.as_bytes());
            strings.push(0);
            offsets.push((k, v));
        }
        let mut out = old_table(entries, &offsets, 0);
        out.extend_from_slice(&strings);
        out
    }

    /// The old header and entries, then `pad` zero bytes. In the compat layout the old table's strings
    /// are the new table's, counted from the end of the old entries: `pad` bytes before the new header.
    fn old_table(entries: &[(i32, &str, &str)], offsets: &[(u32, u32)], pad: usize) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(super::OLD_MAGIC);
        out.push(0);
        out.extend_from_slice(&(entries.len() as u32).to_ne_bytes());
        for ((flags, _, _), (k, v)) in entries.iter().zip(offsets) {
            out.extend_from_slice(&flags.to_ne_bytes());
            out.extend_from_slice(&(k + pad as u32).to_ne_bytes());
            out.extend_from_slice(&(v + pad as u32).to_ne_bytes());
        }
        out.extend(std::iter::repeat_n(0u8, pad));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const X86: i32 = 0x0303;
    const ENTRIES: [(i32, &str, &str); 3] = [
        (
            X86,
            "libnvidia-ml.so.1",
            "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        ),
        (X86, "libcuda.so.1", "/opt/nvidia/lib/libcuda.so.1"),
        (
            0x0003,
            "libcuda.so.1",
            "/usr/lib/i386-linux-gnu/libcuda.so.1",
        ),
    ];

    fn expected() -> Vec<CacheEntry> {
        ENTRIES
            .iter()
            .map(|(flags, soname, path)| CacheEntry {
                flags: *flags,
                soname: soname.to_string(),
                path: path.to_string(),
            })
            .collect()
    }

    #[test]
    fn reads_the_new_format_alone_and_after_the_old_table() {
        assert_eq!(parse(&build::cache(&ENTRIES, false)), Ok(expected()));
        assert_eq!(parse(&build::cache(&ENTRIES, true)), Ok(expected()));
    }

    #[test]
    fn reads_the_old_format_alone() {
        assert_eq!(parse(&build::old_only(&ENTRIES)), Ok(expected()));
    }

    #[test]
    fn rejects_garbage_and_truncation_without_panicking() {
        assert_eq!(parse(b"not a cache"), Err(LdCacheError::UnknownFormat));
        assert_eq!(parse(b""), Err(LdCacheError::UnknownFormat));
        let full = build::cache(&ENTRIES, true);
        for len in [12, 20, 40, 60, full.len() - 1] {
            assert!(parse(&full[..len]).is_err(), "length {len}");
        }
        let full = build::cache(&ENTRIES, false);
        for len in [NEW_MAGIC.len(), 30, NEW_HEADER + 10, full.len() - 1] {
            assert!(parse(&full[..len]).is_err(), "length {len}");
        }
        // An entry count far beyond the file must not allocate or index out of bounds.
        let mut huge = build::cache(&ENTRIES, false);
        huge[20..24].copy_from_slice(&u32::MAX.to_ne_bytes());
        assert!(parse(&huge).is_err());
    }

    /// The machine's own cache, where there is one: libc must be in it with this machine's flags.
    #[test]
    fn reads_this_machines_cache() {
        let Ok(data) = std::fs::read("/etc/ld.so.cache") else {
            return;
        };
        let entries = parse(&data).unwrap_or_default();
        let native = crate::gpu::HostArch::NATIVE.map(|arch| arch.ld_cache_flags);
        assert!(
            entries
                .iter()
                .any(|e| e.soname == "libc.so.6" && native.is_none_or(|f| e.flags == f)),
            "libc.so.6 missing from {} parsed entries",
            entries.len()
        );
    }
}
