//! An HPACK decoder (RFC 7541) for the `:authority` adapter: it follows the client's compression state
//! and hands each header field to a callback. Hand-written for the adapter's hot path, where every
//! request of the kubelet passes: the Huffman decoding tree is built once per process, and strings that
//! need no decoding are passed as borrowed slices. The `loona-hpack` crate's decoder (the HPACK crate
//! that is kept up; h2 keeps its own private) builds a hash table for every string it decodes, about a
//! tenth of the plugin's CPU time per prepare when the adapter used it; `cargo bench --bench prepare`
//! prints both decoders' CPU time per header block ("HPACK decoding alone").
//!
//! It refuses what h2's decoder refuses (an index of 0 or past the tables, a table size update after a
//! field or above the allowed size, a bad Huffman padding or an EOS symbol in a string, an integer
//! that overflows, a block that ends inside a field), so the adapter's idea of the connection never
//! drifts from the server's.

use std::collections::VecDeque;
use std::sync::OnceLock;

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum HpackError {
    #[error("the header block ends inside a field")]
    Truncated,
    #[error("an integer does not fit")]
    IntegerOverflow,
    #[error("index {0} is not in the static or dynamic table")]
    BadIndex(usize),
    #[error("a dynamic table size update {0} is above the allowed {1}")]
    TableSizeTooLarge(usize, usize),
    #[error("a dynamic table size update after a header field")]
    LateTableSizeUpdate,
    #[error("a Huffman-coded string is invalid: {0}")]
    Huffman(&'static str),
}

/// RFC 7541 Appendix A, indices 1 to 61.
const STATIC_TABLE: [(&[u8], &[u8]); 61] = [
    (b":authority", b""),
    (b":method", b"GET"),
    (b":method", b"POST"),
    (b":path", b"/"),
    (b":path", b"/index.html"),
    (b":scheme", b"http"),
    (b":scheme", b"https"),
    (b":status", b"200"),
    (b":status", b"204"),
    (b":status", b"206"),
    (b":status", b"304"),
    (b":status", b"400"),
    (b":status", b"404"),
    (b":status", b"500"),
    (b"accept-charset", b""),
    (b"accept-encoding", b"gzip, deflate"),
    (b"accept-language", b""),
    (b"accept-ranges", b""),
    (b"accept", b""),
    (b"access-control-allow-origin", b""),
    (b"age", b""),
    (b"allow", b""),
    (b"authorization", b""),
    (b"cache-control", b""),
    (b"content-disposition", b""),
    (b"content-encoding", b""),
    (b"content-language", b""),
    (b"content-length", b""),
    (b"content-location", b""),
    (b"content-range", b""),
    (b"content-type", b""),
    (b"cookie", b""),
    (b"date", b""),
    (b"etag", b""),
    (b"expect", b""),
    (b"expires", b""),
    (b"from", b""),
    (b"host", b""),
    (b"if-match", b""),
    (b"if-modified-since", b""),
    (b"if-none-match", b""),
    (b"if-range", b""),
    (b"if-unmodified-since", b""),
    (b"last-modified", b""),
    (b"link", b""),
    (b"location", b""),
    (b"max-forwards", b""),
    (b"proxy-authenticate", b""),
    (b"proxy-authorization", b""),
    (b"range", b""),
    (b"referer", b""),
    (b"refresh", b""),
    (b"retry-after", b""),
    (b"server", b""),
    (b"set-cookie", b""),
    (b"strict-transport-security", b""),
    (b"transfer-encoding", b""),
    (b"user-agent", b""),
    (b"vary", b""),
    (b"via", b""),
    (b"www-authenticate", b""),
];

/// RFC 7541 Appendix B: the Huffman code of each symbol (0 to 255, then EOS) and its length in bits.
const HUFFMAN_CODES: [(u32, u8); 257] = [
    (0x1ff8, 13),
    (0x7fffd8, 23),
    (0xfffffe2, 28),
    (0xfffffe3, 28),
    (0xfffffe4, 28),
    (0xfffffe5, 28),
    (0xfffffe6, 28),
    (0xfffffe7, 28),
    (0xfffffe8, 28),
    (0xffffea, 24),
    (0x3ffffffc, 30),
    (0xfffffe9, 28),
    (0xfffffea, 28),
    (0x3ffffffd, 30),
    (0xfffffeb, 28),
    (0xfffffec, 28),
    (0xfffffed, 28),
    (0xfffffee, 28),
    (0xfffffef, 28),
    (0xffffff0, 28),
    (0xffffff1, 28),
    (0xffffff2, 28),
    (0x3ffffffe, 30),
    (0xffffff3, 28),
    (0xffffff4, 28),
    (0xffffff5, 28),
    (0xffffff6, 28),
    (0xffffff7, 28),
    (0xffffff8, 28),
    (0xffffff9, 28),
    (0xffffffa, 28),
    (0xffffffb, 28),
    (0x14, 6),
    (0x3f8, 10),
    (0x3f9, 10),
    (0xffa, 12),
    (0x1ff9, 13),
    (0x15, 6),
    (0xf8, 8),
    (0x7fa, 11),
    (0x3fa, 10),
    (0x3fb, 10),
    (0xf9, 8),
    (0x7fb, 11),
    (0xfa, 8),
    (0x16, 6),
    (0x17, 6),
    (0x18, 6),
    (0x0, 5),
    (0x1, 5),
    (0x2, 5),
    (0x19, 6),
    (0x1a, 6),
    (0x1b, 6),
    (0x1c, 6),
    (0x1d, 6),
    (0x1e, 6),
    (0x1f, 6),
    (0x5c, 7),
    (0xfb, 8),
    (0x7ffc, 15),
    (0x20, 6),
    (0xffb, 12),
    (0x3fc, 10),
    (0x1ffa, 13),
    (0x21, 6),
    (0x5d, 7),
    (0x5e, 7),
    (0x5f, 7),
    (0x60, 7),
    (0x61, 7),
    (0x62, 7),
    (0x63, 7),
    (0x64, 7),
    (0x65, 7),
    (0x66, 7),
    (0x67, 7),
    (0x68, 7),
    (0x69, 7),
    (0x6a, 7),
    (0x6b, 7),
    (0x6c, 7),
    (0x6d, 7),
    (0x6e, 7),
    (0x6f, 7),
    (0x70, 7),
    (0x71, 7),
    (0x72, 7),
    (0xfc, 8),
    (0x73, 7),
    (0xfd, 8),
    (0x1ffb, 13),
    (0x7fff0, 19),
    (0x1ffc, 13),
    (0x3ffc, 14),
    (0x22, 6),
    (0x7ffd, 15),
    (0x3, 5),
    (0x23, 6),
    (0x4, 5),
    (0x24, 6),
    (0x5, 5),
    (0x25, 6),
    (0x26, 6),
    (0x27, 6),
    (0x6, 5),
    (0x74, 7),
    (0x75, 7),
    (0x28, 6),
    (0x29, 6),
    (0x2a, 6),
    (0x7, 5),
    (0x2b, 6),
    (0x76, 7),
    (0x2c, 6),
    (0x8, 5),
    (0x9, 5),
    (0x2d, 6),
    (0x77, 7),
    (0x78, 7),
    (0x79, 7),
    (0x7a, 7),
    (0x7b, 7),
    (0x7ffe, 15),
    (0x7fc, 11),
    (0x3ffd, 14),
    (0x1ffd, 13),
    (0xffffffc, 28),
    (0xfffe6, 20),
    (0x3fffd2, 22),
    (0xfffe7, 20),
    (0xfffe8, 20),
    (0x3fffd3, 22),
    (0x3fffd4, 22),
    (0x3fffd5, 22),
    (0x7fffd9, 23),
    (0x3fffd6, 22),
    (0x7fffda, 23),
    (0x7fffdb, 23),
    (0x7fffdc, 23),
    (0x7fffdd, 23),
    (0x7fffde, 23),
    (0xffffeb, 24),
    (0x7fffdf, 23),
    (0xffffec, 24),
    (0xffffed, 24),
    (0x3fffd7, 22),
    (0x7fffe0, 23),
    (0xffffee, 24),
    (0x7fffe1, 23),
    (0x7fffe2, 23),
    (0x7fffe3, 23),
    (0x7fffe4, 23),
    (0x1fffdc, 21),
    (0x3fffd8, 22),
    (0x7fffe5, 23),
    (0x3fffd9, 22),
    (0x7fffe6, 23),
    (0x7fffe7, 23),
    (0xffffef, 24),
    (0x3fffda, 22),
    (0x1fffdd, 21),
    (0xfffe9, 20),
    (0x3fffdb, 22),
    (0x3fffdc, 22),
    (0x7fffe8, 23),
    (0x7fffe9, 23),
    (0x1fffde, 21),
    (0x7fffea, 23),
    (0x3fffdd, 22),
    (0x3fffde, 22),
    (0xfffff0, 24),
    (0x1fffdf, 21),
    (0x3fffdf, 22),
    (0x7fffeb, 23),
    (0x7fffec, 23),
    (0x1fffe0, 21),
    (0x1fffe1, 21),
    (0x3fffe0, 22),
    (0x1fffe2, 21),
    (0x7fffed, 23),
    (0x3fffe1, 22),
    (0x7fffee, 23),
    (0x7fffef, 23),
    (0xfffea, 20),
    (0x3fffe2, 22),
    (0x3fffe3, 22),
    (0x3fffe4, 22),
    (0x7ffff0, 23),
    (0x3fffe5, 22),
    (0x3fffe6, 22),
    (0x7ffff1, 23),
    (0x3ffffe0, 26),
    (0x3ffffe1, 26),
    (0xfffeb, 20),
    (0x7fff1, 19),
    (0x3fffe7, 22),
    (0x7ffff2, 23),
    (0x3fffe8, 22),
    (0x1ffffec, 25),
    (0x3ffffe2, 26),
    (0x3ffffe3, 26),
    (0x3ffffe4, 26),
    (0x7ffffde, 27),
    (0x7ffffdf, 27),
    (0x3ffffe5, 26),
    (0xfffff1, 24),
    (0x1ffffed, 25),
    (0x7fff2, 19),
    (0x1fffe3, 21),
    (0x3ffffe6, 26),
    (0x7ffffe0, 27),
    (0x7ffffe1, 27),
    (0x3ffffe7, 26),
    (0x7ffffe2, 27),
    (0xfffff2, 24),
    (0x1fffe4, 21),
    (0x1fffe5, 21),
    (0x3ffffe8, 26),
    (0x3ffffe9, 26),
    (0xffffffd, 28),
    (0x7ffffe3, 27),
    (0x7ffffe4, 27),
    (0x7ffffe5, 27),
    (0xfffec, 20),
    (0xfffff3, 24),
    (0xfffed, 20),
    (0x1fffe6, 21),
    (0x3fffe9, 22),
    (0x1fffe7, 21),
    (0x1fffe8, 21),
    (0x7ffff3, 23),
    (0x3fffea, 22),
    (0x3fffeb, 22),
    (0x1ffffee, 25),
    (0x1ffffef, 25),
    (0xfffff4, 24),
    (0xfffff5, 24),
    (0x3ffffea, 26),
    (0x7ffff4, 23),
    (0x3ffffeb, 26),
    (0x7ffffe6, 27),
    (0x3ffffec, 26),
    (0x3ffffed, 26),
    (0x7ffffe7, 27),
    (0x7ffffe8, 27),
    (0x7ffffe9, 27),
    (0x7ffffea, 27),
    (0x7ffffeb, 27),
    (0xffffffe, 28),
    (0x7ffffec, 27),
    (0x7ffffed, 27),
    (0x7ffffee, 27),
    (0x7ffffef, 27),
    (0x7fffff0, 27),
    (0x3ffffee, 26),
    (0x3fffffff, 30),
];
const EOS: u16 = 256;

/// A field's name or value: borrowed from the block, or decoded into a buffer.
type Field<'a> = std::borrow::Cow<'a, [u8]>;

/// The decoding state of one direction of one connection.
pub struct Decoder {
    /// Newest entry first, as the dynamic table's indices count.
    dynamic: VecDeque<(Vec<u8>, Vec<u8>)>,
    /// The table's size by RFC 7541's measure (each entry: name, value and 32).
    size: usize,
    /// The size the encoder last set.
    max_size: usize,
    /// The most the encoder may set (SETTINGS_HEADER_TABLE_SIZE of the receiver).
    allowed_max_size: usize,
}

impl Decoder {
    pub fn new(allowed_max_size: usize) -> Self {
        Decoder {
            dynamic: VecDeque::new(),
            size: 0,
            max_size: allowed_max_size,
            allowed_max_size,
        }
    }

    /// Decodes one complete header block, calling `field` with each name and value in order. After an
    /// error the state is that of a connection the server closes; do not decode further blocks.
    pub fn decode(
        &mut self,
        block: &[u8],
        mut field: impl FnMut(&[u8], &[u8]),
    ) -> Result<(), HpackError> {
        let mut rest = block;
        let mut fields_seen = false;
        while let Some(&first) = rest.first() {
            if first & 0x80 != 0 {
                // Indexed field.
                let index = integer(&mut rest, 7)?;
                let (name, value) = self.entry(index)?;
                field(name, value);
                fields_seen = true;
            } else if first & 0x40 != 0 {
                // Literal with incremental indexing.
                let (name, value) = self.literal(&mut rest, 6)?;
                field(&name, &value);
                self.insert(name.into_owned(), value.into_owned());
                fields_seen = true;
            } else if first & 0x20 != 0 {
                // Dynamic table size update: only before the block's first field (RFC 7541 §4.2).
                if fields_seen {
                    return Err(HpackError::LateTableSizeUpdate);
                }
                let new_size = integer(&mut rest, 5)?;
                if new_size > self.allowed_max_size {
                    return Err(HpackError::TableSizeTooLarge(
                        new_size,
                        self.allowed_max_size,
                    ));
                }
                self.max_size = new_size;
                self.evict_to(new_size);
            } else {
                // Literal without indexing (0000) or never indexed (0001): both leave the table alone.
                let (name, value) = self.literal(&mut rest, 4)?;
                field(&name, &value);
                fields_seen = true;
            }
        }
        Ok(())
    }

    /// A literal field whose name is an index (when the prefix holds one) or a string, then its value.
    fn literal<'s, 'b: 's>(
        &'s self,
        rest: &mut &'b [u8],
        prefix_bits: u8,
    ) -> Result<(Field<'s>, Field<'b>), HpackError> {
        let index = integer(rest, prefix_bits)?;
        let name = match index {
            0 => string(rest)?,
            index => Field::Borrowed(self.entry(index)?.0),
        };
        let value = string(rest)?;
        Ok((name, value))
    }

    fn entry(&self, index: usize) -> Result<(&[u8], &[u8]), HpackError> {
        match index {
            0 => Err(HpackError::BadIndex(0)),
            1..=61 => Ok(STATIC_TABLE[index - 1]),
            _ => self
                .dynamic
                .get(index - 62)
                .map(|(name, value)| (name.as_slice(), value.as_slice()))
                .ok_or(HpackError::BadIndex(index)),
        }
    }

    fn insert(&mut self, name: Vec<u8>, value: Vec<u8>) {
        let entry_size = name.len() + value.len() + 32;
        if entry_size > self.max_size {
            // An entry larger than the table empties it and is not added (RFC 7541 §4.4).
            self.dynamic.clear();
            self.size = 0;
            return;
        }
        self.evict_to(self.max_size - entry_size);
        self.size += entry_size;
        self.dynamic.push_front((name, value));
    }

    fn evict_to(&mut self, limit: usize) {
        while self.size > limit {
            let Some((name, value)) = self.dynamic.pop_back() else {
                break;
            };
            self.size -= name.len() + value.len() + 32;
        }
    }
}

/// An integer with an N-bit prefix (RFC 7541 §5.1); advances `rest` past it.
fn integer(rest: &mut &[u8], prefix_bits: u8) -> Result<usize, HpackError> {
    let (&first, mut tail) = rest.split_first().ok_or(HpackError::Truncated)?;
    let mask = (1usize << prefix_bits) - 1;
    let mut value = usize::from(first) & mask;
    if value == mask {
        let mut shift = 0u32;
        loop {
            let (&byte, after) = tail.split_first().ok_or(HpackError::Truncated)?;
            tail = after;
            // Five continuation bytes carry 35 bits; h2 stops there too.
            if shift > 28 {
                return Err(HpackError::IntegerOverflow);
            }
            value = value
                .checked_add(usize::from(byte & 0x7f) << shift)
                .ok_or(HpackError::IntegerOverflow)?;
            shift += 7;
            if byte & 0x80 == 0 {
                break;
            }
        }
    }
    *rest = tail;
    Ok(value)
}

/// A string literal (RFC 7541 §5.2), Huffman-decoded when its H bit is set; advances `rest`.
fn string<'a>(rest: &mut &'a [u8]) -> Result<Field<'a>, HpackError> {
    let huffman = rest.first().ok_or(HpackError::Truncated)? & 0x80 != 0;
    let length = integer(rest, 7)?;
    if length > rest.len() {
        return Err(HpackError::Truncated);
    }
    let (bytes, tail) = rest.split_at(length);
    *rest = tail;
    if huffman {
        huffman_decode(bytes).map(Field::Owned)
    } else {
        Ok(Field::Borrowed(bytes))
    }
}

/// The Huffman code as a binary tree: node `n`'s children are `tree[n][bit]`; a child of `LEAF | s`
/// is symbol `s`, 0 is no child yet (the root is node 0 and never a child).
const LEAF: u16 = 0x8000;

fn huffman_tree() -> &'static [[u16; 2]] {
    static TREE: OnceLock<Vec<[u16; 2]>> = OnceLock::new();
    TREE.get_or_init(|| {
        let mut tree = vec![[0u16; 2]];
        for (symbol, &(code, bits)) in HUFFMAN_CODES.iter().enumerate() {
            let mut node = 0usize;
            for position in (0..bits).rev() {
                let bit = ((code >> position) & 1) as usize;
                if position == 0 {
                    tree[node][bit] = LEAF | symbol as u16;
                } else {
                    if tree[node][bit] == 0 {
                        tree.push([0, 0]);
                        tree[node][bit] = (tree.len() - 1) as u16;
                    }
                    node = usize::from(tree[node][bit]);
                }
            }
        }
        tree
    })
}

fn huffman_decode(bytes: &[u8]) -> Result<Vec<u8>, HpackError> {
    let tree = huffman_tree();
    let mut out = Vec::with_capacity(bytes.len() * 8 / 5);
    let mut node = 0usize;
    // Bits since the last symbol, and whether they were all ones: the only padding allowed is a
    // prefix of EOS shorter than a byte (RFC 7541 §5.2).
    let mut pending_bits = 0u32;
    let mut pending_all_ones = true;
    for &byte in bytes {
        for position in (0..8).rev() {
            let bit = usize::from((byte >> position) & 1);
            let next = tree[node][bit];
            pending_bits += 1;
            pending_all_ones &= bit == 1;
            if next & LEAF != 0 {
                let symbol = next & !LEAF;
                if symbol == EOS {
                    return Err(HpackError::Huffman("it holds the EOS symbol"));
                }
                out.push(symbol as u8);
                node = 0;
                pending_bits = 0;
                pending_all_ones = true;
            } else {
                node = usize::from(next);
            }
        }
    }
    if pending_bits > 7 {
        return Err(HpackError::Huffman("the padding is longer than 7 bits"));
    }
    if !pending_all_ones {
        return Err(HpackError::Huffman("the padding is not all ones"));
    }
    Ok(out)
}

#[cfg(test)]
#[path = "hpack_tests.rs"]
mod tests;
