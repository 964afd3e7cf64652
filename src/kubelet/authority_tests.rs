//! The rewriter on hand-made HTTP/2 byte streams, checked by decoding its output as the server would:
//! with one HPACK decoder for the whole connection.

use super::*;

const KUBELET_AUTHORITY: &[u8] =
    b"%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fgpu.dra.dev-reg.sock";

fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    write_frame_header(payload.len(), kind, flags, stream_id, &mut out);
    out.extend_from_slice(payload);
    out
}

fn request_headers(authority: &[u8], path: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    vec![
        (b":method".to_vec(), b"POST".to_vec()),
        (b":scheme".to_vec(), b"http".to_vec()),
        (b":path".to_vec(), path.to_vec()),
        (b":authority".to_vec(), authority.to_vec()),
        (b"content-type".to_vec(), b"application/grpc".to_vec()),
        (b"user-agent".to_vec(), b"grpc-go/1.72.1".to_vec()),
        (b"te".to_vec(), b"trailers".to_vec()),
    ]
}

/// A client connection as grpc-go writes it: preface, SETTINGS, then per request a HEADERS frame
/// HPACK-encoded with incremental indexing (so later requests refer to the dynamic table) and a DATA
/// frame.
fn client_stream(
    encoder: &mut loona_hpack::Encoder<'static>,
    requests: &[Vec<(Vec<u8>, Vec<u8>)>],
) -> Vec<u8> {
    let mut out = CLIENT_PREFACE.to_vec();
    out.extend(frame(0x4, 0, 0, &[]));
    for (i, headers) in requests.iter().enumerate() {
        let stream_id = 1 + 2 * i as u32;
        let block = encoder.encode(headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        out.extend(frame(FRAME_HEADERS, FLAG_END_HEADERS, stream_id, &block));
        out.extend(frame(0x0, FLAG_END_STREAM, stream_id, b"\0\0\0\0\x05hello"));
    }
    out
}

#[derive(Debug, PartialEq)]
enum Seen {
    Headers {
        stream_id: u32,
        end_stream: bool,
        headers: Vec<(Vec<u8>, Vec<u8>)>,
    },
    Other {
        kind: u8,
        stream_id: u32,
        payload: Vec<u8>,
    },
}

/// What the server makes of `bytes`: frames, with header blocks joined and decoded.
fn server_view(bytes: &[u8]) -> Vec<Seen> {
    assert!(
        bytes.starts_with(CLIENT_PREFACE),
        "the preface must come first"
    );
    let mut decoder = loona_hpack::Decoder::new();
    let mut seen = Vec::new();
    let mut rest = &bytes[CLIENT_PREFACE.len()..];
    let mut block: Option<(u32, bool, Vec<u8>)> = None;
    while !rest.is_empty() {
        let length = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
        assert!(length <= MAX_FRAME_PAYLOAD, "frame of {length} bytes");
        let (kind, flags) = (rest[3], rest[4]);
        let stream_id = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]);
        let mut payload = &rest[FRAME_HEADER_LEN..FRAME_HEADER_LEN + length];
        rest = &rest[FRAME_HEADER_LEN + length..];
        match kind {
            FRAME_HEADERS => {
                let mut pad = 0;
                if flags & FLAG_PADDED != 0 {
                    pad = usize::from(payload[0]);
                    payload = &payload[1..];
                }
                if flags & FLAG_PRIORITY != 0 {
                    payload = &payload[5..];
                }
                payload = &payload[..payload.len() - pad];
                block = Some((stream_id, flags & FLAG_END_STREAM != 0, payload.to_vec()));
            }
            FRAME_CONTINUATION => block.as_mut().unwrap().2.extend_from_slice(payload),
            _ => {
                assert!(block.is_none(), "frame inside a header block");
                seen.push(Seen::Other {
                    kind,
                    stream_id,
                    payload: payload.to_vec(),
                });
                continue;
            }
        }
        if flags & FLAG_END_HEADERS != 0 {
            let (stream_id, end_stream, fragments) = block.take().unwrap();
            seen.push(Seen::Headers {
                stream_id,
                end_stream,
                headers: decoder.decode(&fragments).expect("valid HPACK"),
            });
        }
    }
    assert!(block.is_none(), "unfinished header block");
    seen
}

/// Feeds `input` to a lenient rewriter in pieces of `chunk` bytes.
fn rewrite(input: &[u8], chunk: usize) -> (Vec<u8>, AuthorityRewriter) {
    let mut rewriter = AuthorityRewriter::new(lenient_policy());
    let mut out = Vec::new();
    for piece in input.chunks(chunk) {
        rewriter.feed(piece, &mut out);
    }
    (out, rewriter)
}

fn authorities(seen: &[Seen]) -> Vec<Vec<u8>> {
    seen.iter()
        .filter_map(|s| match s {
            Seen::Headers { headers, .. } => headers
                .iter()
                .find(|(n, _)| n.as_slice() == b":authority")
                .map(|(_, v)| v.clone()),
            Seen::Other { .. } => None,
        })
        .collect()
}

#[test]
fn a_valid_authority_passes_through_byte_for_byte() {
    let mut encoder = loona_hpack::Encoder::new();
    let requests = [
        request_headers(b"localhost", b"/pluginregistration.Registration/GetInfo"),
        request_headers(
            b"localhost",
            b"/pluginregistration.Registration/NotifyRegistrationStatus",
        ),
    ];
    let input = client_stream(&mut encoder, &requests);
    for chunk in [1, 7, 9, 4096] {
        let (out, rewriter) = rewrite(&input, chunk);
        assert_eq!(out, input, "chunk {chunk}");
        assert_eq!(rewriter.rewritten(), 0);
    }
}

#[test]
fn the_kubelets_percent_encoded_path_becomes_localhost_in_every_request() {
    let mut encoder = loona_hpack::Encoder::new();
    // The second and third requests refer to the first one's table entries (indexed `:authority`).
    let requests = [
        request_headers(
            KUBELET_AUTHORITY,
            b"/pluginregistration.Registration/GetInfo",
        ),
        request_headers(
            KUBELET_AUTHORITY,
            b"/pluginregistration.Registration/NotifyRegistrationStatus",
        ),
        request_headers(
            KUBELET_AUTHORITY,
            b"/pluginregistration.Registration/GetInfo",
        ),
    ];
    let input = client_stream(&mut encoder, &requests);
    let expected = server_view(&input);
    for chunk in [1, 2, 9, 10, 100, 4096] {
        let (out, rewriter) = rewrite(&input, chunk);
        let seen = server_view(&out);
        assert_eq!(
            authorities(&seen),
            vec![LOCAL_AUTHORITY.to_vec(); 3],
            "chunk {chunk}"
        );
        assert_eq!(rewriter.rewritten(), 3);
        // Everything else is as the client sent it: other headers in order, DATA, stream ids.
        let without_authority = |view: &[Seen]| -> Vec<Seen> {
            view.iter()
                .map(|s| match s {
                    Seen::Headers {
                        stream_id,
                        end_stream,
                        headers,
                    } => Seen::Headers {
                        stream_id: *stream_id,
                        end_stream: *end_stream,
                        headers: headers
                            .iter()
                            .filter(|(n, _)| n.as_slice() != b":authority")
                            .cloned()
                            .collect(),
                    },
                    Seen::Other {
                        kind,
                        stream_id,
                        payload,
                    } => Seen::Other {
                        kind: *kind,
                        stream_id: *stream_id,
                        payload: payload.clone(),
                    },
                })
                .collect()
        };
        assert_eq!(without_authority(&seen), without_authority(&expected));
    }
}

#[test]
fn blocks_after_a_rewrite_are_re_encoded_even_with_a_valid_authority() {
    // The client's table holds entries the server never saw once a block was re-encoded, so a later
    // block that refers to them must be re-encoded too, or the server would decode other headers.
    let mut encoder = loona_hpack::Encoder::new();
    let requests = [
        request_headers(KUBELET_AUTHORITY, b"/a"),
        request_headers(b"localhost", b"/b"),
        request_headers(b"localhost", b"/b"),
    ];
    let (out, rewriter) = rewrite(&client_stream(&mut encoder, &requests), 3);
    assert_eq!(
        authorities(&server_view(&out)),
        vec![LOCAL_AUTHORITY.to_vec(); 3]
    );
    assert_eq!(rewriter.rewritten(), 1);
}

#[test]
fn other_authorities_that_h2_refuses_are_replaced_and_good_ones_kept() {
    for (authority, replaced) in [
        (&b"/var/lib/kubelet/plugins/gpu.dra.dev/dra.sock"[..], true),
        (b"", true),
        (b"has space", true),
        (b"localhost:50051", false),
        (b"[::1]:8080", false),
        (b"gpu-dra.example", false),
    ] {
        let mut encoder = loona_hpack::Encoder::new();
        let input = client_stream(&mut encoder, &[request_headers(authority, b"/x")]);
        let (out, _) = rewrite(&input, 5);
        let expected: &[u8] = if replaced { LOCAL_AUTHORITY } else { authority };
        assert_eq!(
            authorities(&server_view(&out)),
            vec![expected.to_vec()],
            "{}",
            String::from_utf8_lossy(authority)
        );
    }
}

#[test]
fn padding_priority_and_continuation_frames_are_understood() {
    let mut encoder = loona_hpack::Encoder::new();
    let headers = request_headers(KUBELET_AUTHORITY, b"/x");
    let block = encoder.encode(headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
    let (head, tail) = block.split_at(10);
    let mut payload = vec![3u8]; // pad length
    payload.extend_from_slice(&[0x80, 0, 0, 1, 15]); // exclusive dependency on stream 1, weight 16
    payload.extend_from_slice(head);
    payload.extend_from_slice(&[0, 0, 0]);
    let mut input = CLIENT_PREFACE.to_vec();
    input.extend(frame(
        FRAME_HEADERS,
        FLAG_PADDED | FLAG_PRIORITY | FLAG_END_STREAM,
        3,
        &payload,
    ));
    input.extend(frame(FRAME_CONTINUATION, FLAG_END_HEADERS, 3, tail));
    let (out, _) = rewrite(&input, 4);
    let seen = server_view(&out);
    assert_eq!(
        seen,
        vec![Seen::Headers {
            stream_id: 3,
            end_stream: true,
            headers: request_headers(LOCAL_AUTHORITY, b"/x"),
        }]
    );
    // The priority survives the re-encoding.
    let first = &out[CLIENT_PREFACE.len()..];
    assert_eq!(first[4] & FLAG_PRIORITY, FLAG_PRIORITY);
    assert_eq!(
        &first[FRAME_HEADER_LEN..FRAME_HEADER_LEN + 5],
        &[0x80, 0, 0, 1, 15]
    );
}

#[test]
fn a_re_encoded_block_over_16_kib_is_split_into_continuation_frames() {
    let mut encoder = loona_hpack::Encoder::new();
    let mut headers = request_headers(KUBELET_AUTHORITY, b"/x");
    headers.push((b"x-big".to_vec(), vec![b'a'; 20_000]));
    let input = client_stream(&mut encoder, &[headers.clone()]);
    let (out, _) = rewrite(&input, 1000);
    let mut expected = headers;
    expected[3].1 = LOCAL_AUTHORITY.to_vec();
    // [0] is the SETTINGS frame.
    match &server_view(&out)[1] {
        Seen::Headers { headers, .. } => assert_eq!(headers, &expected),
        other => panic!("expected headers, got {other:?}"),
    }
    let continuation = &out[CLIENT_PREFACE.len() + 9 + FRAME_HEADER_LEN + MAX_FRAME_PAYLOAD..];
    assert_eq!(continuation[3], FRAME_CONTINUATION);
}

#[test]
fn what_is_not_http2_or_not_valid_hpack_passes_through_unchanged() {
    let http1 = b"GET / HTTP/1.1\r\nHost: /var/run/x.sock\r\n\r\n".to_vec();
    assert_eq!(rewrite(&http1, 3).0, http1);

    // An index that no table holds: h2 must see it and answer COMPRESSION_ERROR itself.
    let mut bad = CLIENT_PREFACE.to_vec();
    bad.extend(frame(FRAME_HEADERS, FLAG_END_HEADERS, 1, &[0xff, 0x7f]));
    bad.extend(frame(0x0, FLAG_END_STREAM, 1, b"x"));
    let (out, rewriter) = rewrite(&bad, 2);
    assert_eq!(out, bad);
    assert!(rewriter.is_transparent());

    // A DATA frame inside a header block is a protocol error; the frames go on as they came.
    let mut interleaved = CLIENT_PREFACE.to_vec();
    interleaved.extend(frame(FRAME_HEADERS, 0, 1, &[0x82]));
    interleaved.extend(frame(0x0, 0, 1, b"x"));
    assert_eq!(rewrite(&interleaved, 1).0, interleaved);
}

#[test]
fn a_header_block_over_the_limit_is_not_buffered() {
    let mut input = CLIENT_PREFACE.to_vec();
    input.extend(frame(FRAME_HEADERS, 0, 1, &vec![0u8; MAX_FRAME_PAYLOAD]));
    for _ in 0..4 {
        input.extend(frame(
            FRAME_CONTINUATION,
            0,
            1,
            &vec![0u8; MAX_FRAME_PAYLOAD],
        ));
    }
    let (out, rewriter) = rewrite(&input, 4096);
    assert_eq!(out, input);
    assert!(rewriter.is_transparent());
}

#[test]
fn hpack_string_lengths_use_the_seven_bit_prefix() {
    let mut out = Vec::new();
    encode_string(&[b'a'; 126], &mut out);
    assert_eq!(out[0], 126);
    out.clear();
    encode_string(&[b'a'; 127], &mut out);
    assert_eq!(&out[..2], &[0x7f, 0x00]);
    out.clear();
    encode_string(&[b'a'; 1337], &mut out);
    // RFC 7541 C.1.2 encodes 1337 with a 5-bit prefix; with 7 bits it is 127 + 1210.
    assert_eq!(&out[..3], &[0x7f, 0xba, 0x09]);
}
