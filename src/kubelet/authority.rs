//! HTTP/2 `:authority` repair on the kubelet's Unix sockets.
//!
//! The kubelet dials a plugin's registration socket by its raw path, so grpc-go sends the
//! percent-encoded path (`%2Fvar%2Flib%2Fkubelet%2F...`) as `:authority`. The `h2` crate under tonic
//! checks `:authority` with the `http` crate's URI grammar, which forbids `%` in a host, and resets
//! every such stream with PROTOCOL_ERROR (hyperium/h2#487 would relax that; it is not merged). A Unix
//! socket has no host to check, so this module sits between the socket and tonic and replaces any
//! `:authority` that `http` would reject with `localhost`, which is what grpc-go sends for `unix:`
//! targets.
//!
//! [`AuthorityRewriter`] reads the client's half of the connection frame by frame. Every frame but
//! HEADERS and CONTINUATION passes through untouched. Header blocks are HPACK-decoded to follow the
//! client's compression state; a block is passed on byte for byte until one carries an authority to
//! replace. From then on every block of that connection is re-encoded as plain literals that never
//! touch the server's dynamic table, because the client's later blocks may refer to table entries the
//! server never saw. Input it cannot follow (not HTTP/2, bad HPACK, an oversized block) is passed on
//! unchanged from that point, so h2 reports the error it would have reported anyway.
//!
//! The same rewriter serves the kubelet double, which uses it on its outgoing bytes to send the
//! authority the real kubelet sends (see `tests/support/kubelet.rs`).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// What every HTTP/2 client sends first (RFC 9113 §3.4).
const CLIENT_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER_LEN: usize = 9;
const FRAME_HEADERS: u8 = 0x1;
const FRAME_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
/// The smallest SETTINGS_MAX_FRAME_SIZE a peer may set, so re-encoded frames always fit.
const MAX_FRAME_PAYLOAD: usize = 16_384;
/// SETTINGS_HEADER_TABLE_SIZE's default; h2 advertises no other, so no client may use a larger table.
const HPACK_TABLE_SIZE: usize = 4_096;
/// Header blocks larger than this are not followed: hyper refuses header lists over 16 KiB anyway.
const MAX_HEADER_BLOCK: usize = 64 * 1024;
/// Where grpc-go sends an authority for `unix:` targets, and what a rejected authority becomes.
pub const LOCAL_AUTHORITY: &[u8] = b"localhost";

/// Decides what a header block's `:authority` becomes: `Some(new)` replaces it, `None` keeps it.
pub type AuthorityPolicy = Arc<dyn Fn(&[u8]) -> Option<Vec<u8>> + Send + Sync>;

/// The server-side policy: an authority the `http` crate (and so h2) would refuse becomes `localhost`.
pub fn lenient_policy() -> AuthorityPolicy {
    Arc::new(|authority: &[u8]| {
        if http::uri::Authority::try_from(authority).is_ok() {
            None
        } else {
            Some(LOCAL_AUTHORITY.to_vec())
        }
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the 24-byte client preface.
    Preface,
    /// Reading frames.
    Frames,
    /// Passing everything through: the stream is not one this rewriter can follow.
    Transparent,
}

/// A header block being collected: HEADERS plus any CONTINUATION frames.
struct PendingBlock {
    stream_id: u32,
    end_stream: bool,
    /// The 5 priority bytes of the HEADERS frame, if it carried them.
    priority: Option<[u8; 5]>,
    /// The frames as received, for passing on unchanged.
    raw: Vec<u8>,
    /// The HPACK fragments, padding and priority removed.
    fragments: Vec<u8>,
}

/// Follows the client's half of an HTTP/2 connection and rewrites `:authority` by a policy.
pub struct AuthorityRewriter {
    policy: AuthorityPolicy,
    phase: Phase,
    /// Input not yet forwarded: a partial frame header, a partial header frame, or a partial preface.
    input: Vec<u8>,
    /// Payload bytes of the current non-header frame still to pass through.
    passthrough_left: usize,
    block: Option<PendingBlock>,
    decoder: super::hpack::Decoder,
    /// Set once a block was re-encoded: every later block must be re-encoded too.
    reencoding: bool,
    rewritten: u64,
}

impl AuthorityRewriter {
    pub fn new(policy: AuthorityPolicy) -> Self {
        let decoder = super::hpack::Decoder::new(HPACK_TABLE_SIZE);
        AuthorityRewriter {
            policy,
            phase: Phase::Preface,
            input: Vec::new(),
            passthrough_left: 0,
            block: None,
            decoder,
            reencoding: false,
            rewritten: 0,
        }
    }

    /// How many header blocks had their `:authority` replaced.
    pub fn rewritten(&self) -> u64 {
        self.rewritten
    }

    /// Whether the rewriter gave up following the stream and passes bytes on unchanged.
    pub fn is_transparent(&self) -> bool {
        self.phase == Phase::Transparent
    }

    /// Takes bytes the client sent and appends to `out` what the server should receive. Bytes that
    /// end in the middle of a header frame are held until the rest arrives.
    pub fn feed(&mut self, bytes: &[u8], out: &mut Vec<u8>) {
        if self.phase == Phase::Transparent {
            out.extend_from_slice(bytes);
            return;
        }
        let mut bytes = bytes;
        // A DATA frame's payload that continues in this read goes straight through, without a copy
        // into `input`: on the prepare path most bytes are message payload.
        if self.passthrough_left > 0 && self.input.is_empty() {
            let n = self.passthrough_left.min(bytes.len());
            out.extend_from_slice(&bytes[..n]);
            self.passthrough_left -= n;
            bytes = &bytes[n..];
        }
        self.input.extend_from_slice(bytes);
        let consumed = self.process(out);
        self.input.drain(..consumed);
    }

    /// Passes on what can be passed on; returns how many bytes of `input` were used.
    fn process(&mut self, out: &mut Vec<u8>) -> usize {
        let mut at = 0;
        loop {
            let rest = &self.input[at..];
            match self.phase {
                Phase::Transparent => {
                    out.extend_from_slice(rest);
                    return self.input.len();
                }
                Phase::Preface => {
                    let n = rest.len().min(CLIENT_PREFACE.len());
                    if rest[..n] != CLIENT_PREFACE[..n] {
                        self.phase = Phase::Transparent;
                        continue;
                    }
                    if n < CLIENT_PREFACE.len() {
                        return at;
                    }
                    out.extend_from_slice(CLIENT_PREFACE);
                    at += CLIENT_PREFACE.len();
                    self.phase = Phase::Frames;
                }
                Phase::Frames => {
                    if self.passthrough_left > 0 {
                        let n = self.passthrough_left.min(rest.len());
                        out.extend_from_slice(&rest[..n]);
                        self.passthrough_left -= n;
                        at += n;
                        if self.passthrough_left > 0 {
                            return at;
                        }
                        continue;
                    }
                    if rest.len() < FRAME_HEADER_LEN {
                        return at;
                    }
                    let length = usize::from(rest[0]) << 16
                        | usize::from(rest[1]) << 8
                        | usize::from(rest[2]);
                    let kind = rest[3];
                    let is_header_frame = (kind == FRAME_HEADERS && self.block.is_none())
                        || (kind == FRAME_CONTINUATION && self.block.is_some());
                    if !is_header_frame {
                        if self.block.is_some() || kind == FRAME_CONTINUATION {
                            // Only CONTINUATION may follow an unfinished block, and only there: a
                            // protocol error that h2 reports once it sees the frames as they came.
                            self.give_up(out);
                            continue;
                        }
                        out.extend_from_slice(&rest[..FRAME_HEADER_LEN]);
                        self.passthrough_left = length;
                        at += FRAME_HEADER_LEN;
                        continue;
                    }
                    let collected = self.block.as_ref().map_or(0, |b| b.raw.len());
                    if collected + FRAME_HEADER_LEN + length > MAX_HEADER_BLOCK {
                        self.give_up(out);
                        continue;
                    }
                    if rest.len() < FRAME_HEADER_LEN + length {
                        return at;
                    }
                    let frame = &rest[..FRAME_HEADER_LEN + length];
                    at += frame.len();
                    let frame = frame.to_vec();
                    if !self.collect(&frame) {
                        // Malformed padding or priority: pass it on for h2 to refuse.
                        self.give_up(out);
                        out.extend_from_slice(&frame);
                        continue;
                    }
                    if frame[4] & FLAG_END_HEADERS != 0 {
                        self.finish_block(out);
                    }
                }
            }
        }
    }

    /// Adds one HEADERS or CONTINUATION frame to the pending block; false if it is malformed.
    fn collect(&mut self, frame: &[u8]) -> bool {
        let kind = frame[3];
        let flags = frame[4];
        let stream_id = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff;
        let payload = &frame[FRAME_HEADER_LEN..];
        if kind == FRAME_CONTINUATION {
            let Some(block) = self.block.as_mut() else {
                return false;
            };
            block.raw.extend_from_slice(frame);
            block.fragments.extend_from_slice(payload);
            return true;
        }
        let mut fragment = payload;
        let mut pad = 0;
        if flags & FLAG_PADDED != 0 {
            let Some((&length, remainder)) = fragment.split_first() else {
                return false;
            };
            pad = usize::from(length);
            fragment = remainder;
        }
        let mut priority = None;
        if flags & FLAG_PRIORITY != 0 {
            if fragment.len() < 5 {
                return false;
            }
            let mut bytes = [0u8; 5];
            bytes.copy_from_slice(&fragment[..5]);
            priority = Some(bytes);
            fragment = &fragment[5..];
        }
        if pad > fragment.len() {
            return false;
        }
        fragment = &fragment[..fragment.len() - pad];
        self.block = Some(PendingBlock {
            stream_id,
            end_stream: flags & FLAG_END_STREAM != 0,
            priority,
            raw: frame.to_vec(),
            fragments: fragment.to_vec(),
        });
        true
    }

    /// Decodes a complete block and passes it on, verbatim or re-encoded.
    fn finish_block(&mut self, out: &mut Vec<u8>) {
        let Some(block) = self.block.take() else {
            return;
        };
        let mut headers: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let decoded = self.decoder.decode(&block.fragments, |name, value| {
            headers.push((name.to_vec(), value.to_vec()))
        });
        if decoded.is_err() {
            // The server's decoder fails on the same bytes; let it say so.
            out.extend_from_slice(&block.raw);
            self.phase = Phase::Transparent;
            return;
        }
        let mut replaced = false;
        for (name, value) in headers.iter_mut() {
            if name.as_slice() == b":authority" {
                if let Some(new) = (self.policy)(value) {
                    *value = new;
                    replaced = true;
                }
            }
        }
        if replaced {
            self.reencoding = true;
            self.rewritten += 1;
        }
        if self.reencoding {
            write_header_block(&block, &headers, out);
        } else {
            out.extend_from_slice(&block.raw);
        }
    }

    /// Stops following the stream: what was collected goes on unchanged, and so does everything after.
    fn give_up(&mut self, out: &mut Vec<u8>) {
        if let Some(block) = self.block.take() {
            out.extend_from_slice(&block.raw);
        }
        self.phase = Phase::Transparent;
    }
}

/// Encodes `headers` as literals without indexing (no Huffman), so the server's dynamic table is never
/// touched, and frames them as HEADERS plus CONTINUATION frames of at most 16 KiB.
fn write_header_block(block: &PendingBlock, headers: &[(Vec<u8>, Vec<u8>)], out: &mut Vec<u8>) {
    let mut encoded = Vec::with_capacity(block.fragments.len() + 64);
    if let Some(priority) = block.priority {
        encoded.extend_from_slice(&priority);
    }
    for (name, value) in headers {
        encoded.push(0x00);
        encode_string(name, &mut encoded);
        encode_string(value, &mut encoded);
    }
    let mut first = true;
    let mut chunks = encoded.chunks(MAX_FRAME_PAYLOAD).peekable();
    if chunks.peek().is_none() {
        // An empty block (trailers with no fields) still needs its HEADERS frame.
        let flags = FLAG_END_HEADERS | if block.end_stream { FLAG_END_STREAM } else { 0 };
        write_frame_header(0, FRAME_HEADERS, flags, block.stream_id, out);
        return;
    }
    while let Some(chunk) = chunks.next() {
        let last = chunks.peek().is_none();
        let (kind, mut flags) = if first {
            let mut flags = if block.end_stream { FLAG_END_STREAM } else { 0 };
            if block.priority.is_some() {
                flags |= FLAG_PRIORITY;
            }
            (FRAME_HEADERS, flags)
        } else {
            (FRAME_CONTINUATION, 0)
        };
        if last {
            flags |= FLAG_END_HEADERS;
        }
        write_frame_header(chunk.len(), kind, flags, block.stream_id, out);
        out.extend_from_slice(chunk);
        first = false;
    }
}

fn write_frame_header(length: usize, kind: u8, flags: u8, stream_id: u32, out: &mut Vec<u8>) {
    // `length` is at most MAX_FRAME_PAYLOAD, so it fits the 24-bit field.
    out.extend_from_slice(&(length as u32).to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&(stream_id & 0x7fff_ffff).to_be_bytes());
}

/// An HPACK string literal without Huffman coding (RFC 7541 §5.2): a 7-bit-prefix length, then bytes.
fn encode_string(bytes: &[u8], out: &mut Vec<u8>) {
    let mut length = bytes.len();
    if length < 0x7f {
        out.push(length as u8);
    } else {
        out.push(0x7f);
        length -= 0x7f;
        while length >= 0x80 {
            out.push((length as u8 & 0x7f) | 0x80);
            length >>= 7;
        }
        out.push(length as u8);
    }
    out.extend_from_slice(bytes);
}

/// A server-side connection whose incoming bytes go through an [`AuthorityRewriter`]; writes go
/// straight to the socket.
pub struct LenientAuthority<S> {
    inner: S,
    rewriter: AuthorityRewriter,
    /// Rewritten bytes not yet handed to the reader.
    ready: Vec<u8>,
    ready_at: usize,
    scratch: Box<[u8]>,
}

impl<S> LenientAuthority<S> {
    pub fn new(inner: S) -> Self {
        Self::with_policy(inner, lenient_policy())
    }

    pub fn with_policy(inner: S, policy: AuthorityPolicy) -> Self {
        LenientAuthority {
            inner,
            rewriter: AuthorityRewriter::new(policy),
            ready: Vec::new(),
            ready_at: 0,
            scratch: vec![0u8; 16 * 1024].into_boxed_slice(),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for LenientAuthority<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.ready_at < this.ready.len() {
                let n = buf.remaining().min(this.ready.len() - this.ready_at);
                buf.put_slice(&this.ready[this.ready_at..this.ready_at + n]);
                this.ready_at += n;
                if this.ready_at == this.ready.len() {
                    this.ready.clear();
                    this.ready_at = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.rewriter.is_transparent() {
                return Pin::new(&mut this.inner).poll_read(cx, buf);
            }
            let mut scratch = ReadBuf::new(&mut this.scratch);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut scratch))?;
            if scratch.filled().is_empty() {
                return Poll::Ready(Ok(()));
            }
            this.rewriter.feed(scratch.filled(), &mut this.ready);
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for LenientAuthority<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected
    for LenientAuthority<S>
{
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
#[path = "authority_tests.rs"]
mod tests;
