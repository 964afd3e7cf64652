use super::*;

fn hex(text: &str) -> Vec<u8> {
    let digits: String = text.split_whitespace().collect();
    (0..digits.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&digits[i..i + 2], 16).unwrap())
        .collect()
}

fn decode_all(decoder: &mut Decoder, block: &[u8]) -> Result<Vec<(String, String)>, HpackError> {
    let mut fields = Vec::new();
    decoder.decode(block, |name, value| {
        fields.push((
            String::from_utf8_lossy(name).into_owned(),
            String::from_utf8_lossy(value).into_owned(),
        ))
    })?;
    Ok(fields)
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect()
}

/// RFC 7541 Appendix C.3 and C.4: three requests on one connection, without and with Huffman coding.
#[test]
fn decodes_the_rfc_request_examples_and_keeps_the_table_as_the_rfc_says() {
    for blocks in [
        [
            "8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
            "8286 84be 5808 6e6f 2d63 6163 6865",
            "8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65",
        ],
        [
            "8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff",
            "8286 84be 5886 a8eb 1064 9cbf",
            "8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf",
        ],
    ] {
        let mut decoder = Decoder::new(4096);
        assert_eq!(
            decode_all(&mut decoder, &hex(blocks[0])).unwrap(),
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com")
            ])
        );
        assert_eq!(decoder.size, 57);
        assert_eq!(
            decode_all(&mut decoder, &hex(blocks[1])).unwrap(),
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
                ("cache-control", "no-cache")
            ])
        );
        assert_eq!(decoder.size, 110);
        assert_eq!(
            decode_all(&mut decoder, &hex(blocks[2])).unwrap(),
            pairs(&[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/index.html"),
                (":authority", "www.example.com"),
                ("custom-key", "custom-value")
            ])
        );
        assert_eq!(decoder.size, 164);
        assert_eq!(decoder.entry(62).unwrap().0, b"custom-key");
        assert_eq!(decoder.entry(64).unwrap().0, b":authority");
    }
}

/// A Huffman encoder for the tests, straight from the code table.
fn huffman_encode(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u64, 0u32);
    for &byte in bytes {
        let (code, length) = HUFFMAN_CODES[usize::from(byte)];
        acc = (acc << length) | u64::from(code);
        bits += u32::from(length);
        while bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    if bits > 0 {
        // Pad with the most significant bits of EOS: ones.
        out.push(((acc << (8 - bits)) as u8) | ((1u8 << (8 - bits)) - 1));
    }
    out
}

#[test]
fn every_byte_value_round_trips_through_the_huffman_code() {
    let all: Vec<u8> = (0..=255).collect();
    assert_eq!(huffman_decode(&huffman_encode(&all)).unwrap(), all);
    for text in [
        &b""[..],
        b"a",
        b"localhost",
        b"%2Fvar%2Flib%2Fkubelet%2Fplugins_registry",
    ] {
        assert_eq!(huffman_decode(&huffman_encode(text)).unwrap(), text);
    }
}

#[test]
fn bad_huffman_strings_are_refused() {
    // Padding of 8 ones: longer than 7 bits.
    let mut long_padding = huffman_encode(b"a");
    long_padding.push(0xff);
    assert_eq!(
        huffman_decode(&long_padding),
        Err(HpackError::Huffman("the padding is longer than 7 bits"))
    );
    // 'a' is 00011 (5 bits); padding 000 instead of 111.
    assert_eq!(
        huffman_decode(&[0b0001_1000]),
        Err(HpackError::Huffman("the padding is not all ones"))
    );
    // EOS (30 ones) spelled out, then padding.
    assert_eq!(
        huffman_decode(&[0xff, 0xff, 0xff, 0xff]),
        Err(HpackError::Huffman("it holds the EOS symbol"))
    );
}

#[test]
fn malformed_blocks_are_refused_as_h2_refuses_them() {
    let mut decoder = Decoder::new(4096);
    assert_eq!(
        decode_all(&mut decoder, &[0x80]),
        Err(HpackError::BadIndex(0))
    );
    assert_eq!(
        decode_all(&mut decoder, &[0xbe]),
        Err(HpackError::BadIndex(62))
    );
    // A literal whose value is cut short.
    assert_eq!(
        decode_all(&mut decoder, &hex("0004 6e61 6d65 05 61")),
        Err(HpackError::Truncated)
    );
    // An integer continuation that never ends, and one that overflows.
    assert_eq!(
        decode_all(&mut decoder, &[0xff, 0x80]),
        Err(HpackError::Truncated)
    );
    assert_eq!(
        decode_all(&mut decoder, &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]),
        Err(HpackError::IntegerOverflow)
    );
    // A size update to 4097 (31 + 98 + 31 * 128), above the allowed 4096.
    let mut decoder = Decoder::new(4096);
    assert_eq!(
        decode_all(&mut decoder, &hex("3fe2 1f")),
        Err(HpackError::TableSizeTooLarge(4097, 4096))
    );
    // A size update after a field.
    let mut decoder = Decoder::new(4096);
    assert_eq!(
        decode_all(&mut decoder, &hex("8220")),
        Err(HpackError::LateTableSizeUpdate)
    );
}

#[test]
fn the_table_evicts_oldest_entries_and_a_size_update_shrinks_it() {
    let mut decoder = Decoder::new(4096);
    // Literal with indexing, new name: 'x' * 10 = 'y' * 10 (each entry 52 bytes); 100 of them.
    let mut block = Vec::new();
    for i in 0..100u8 {
        block.extend_from_slice(&[0x40, 10]);
        block.extend_from_slice(&[b'a' + i % 26; 10]);
        block.push(10);
        block.extend_from_slice(&[i; 10]);
    }
    decode_all(&mut decoder, &block).unwrap();
    assert_eq!(decoder.size, 4096 / 52 * 52);
    assert_eq!(decoder.dynamic.len(), 4096 / 52);
    assert_eq!(decoder.entry(62).unwrap().1, &[99u8; 10][..]);
    // Size 0 at the start of the next block empties the table; its entries are gone.
    decode_all(&mut decoder, &[0x20]).unwrap();
    assert_eq!((decoder.size, decoder.dynamic.len()), (0, 0));
    assert_eq!(decoder.entry(62), Err(HpackError::BadIndex(62)));
}

/// What an independent encoder writes (loona-hpack's, with indexing), decoded the same.
#[test]
fn agrees_with_another_encoder_over_many_blocks() {
    let mut encoder = loona_hpack::Encoder::new();
    let mut decoder = Decoder::new(4096);
    for i in 0..200 {
        let timeout = format!("{}m", 44_999 - i);
        let path = format!("/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/Node{i}");
        let headers: Vec<(&[u8], &[u8])> = vec![
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path.as_bytes()),
            (b":authority", b"localhost"),
            (b"content-type", b"application/grpc"),
            (b"grpc-timeout", timeout.as_bytes()),
        ];
        let block = encoder.encode(headers.iter().copied());
        let decoded = decode_all(&mut decoder, &block).unwrap();
        let expected: Vec<(String, String)> = headers
            .iter()
            .map(|(n, v)| {
                (
                    String::from_utf8_lossy(n).into_owned(),
                    String::from_utf8_lossy(v).into_owned(),
                )
            })
            .collect();
        assert_eq!(decoded, expected, "block {i}");
    }
}
