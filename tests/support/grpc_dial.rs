//! How the kubelet's grpc-go client reaches a plugin's Unix sockets, down to the HTTP/2 `:authority`.
//!
//! - Registration: `grpc.DialContext(ctx, socketPath, ...)` with a custom dialer. The target has no
//!   scheme, so grpc-go takes it as a passthrough endpoint and sends `encodeAuthority(socketPath)`:
//!   the path with `/` (and anything else outside RFC 3986's authority characters) percent-encoded.
//! - DRA and health (1.34+): `grpc.NewClient("unix:" + endpoint)`. The unix resolver overrides the
//!   authority with `localhost`.
//!
//! tonic's client builds `:authority` from an `http::Uri`, which cannot hold a percent-encoded path,
//! so the double connects with `localhost` and rewrites its own outgoing header blocks with the
//! driver's [`AuthorityRewriter`](crate::kubelet::authority::AuthorityRewriter).

use std::future::Future;
use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::UnixStream;

use crate::kubelet::authority::AuthorityRewriter;

/// The URI tonic is given; only its authority reaches the wire, as `unix:` targets send it.
pub const UNIX_TARGET_URI: &str = "http://localhost";

/// How the client names the socket in `:authority`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dial {
    /// `grpc.DialContext(ctx, "/path/to.sock", WithContextDialer(...))`: the percent-encoded path.
    RawPath,
    /// `grpc.NewClient("unix:/path/to.sock")`: `localhost`.
    UnixScheme,
}

/// grpc-go's `encodeAuthority`: escapes every byte but alphanumerics, `-_.~`, the sub-delimiters
/// `!$&'()*+,;=` and `:[]@`, as `%XX` with upper-case hex.
pub fn encode_authority(path: &str) -> String {
    let mut encoded = String::with_capacity(path.len() * 3);
    for byte in path.bytes() {
        let keep = byte.is_ascii_alphanumeric() || b"-_.~!$&'()*+,;=:[]@".contains(&byte);
        if keep {
            encoded.push(char::from(byte));
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    encoded
}

/// A tower connector that reaches `path` over a Unix socket and names it in `:authority` as `dial` says.
pub fn unix_connector(
    path: &Path,
    dial: Dial,
) -> impl tower::Service<
    tonic::transport::Uri,
    Response = TokioIo<GrpcGoStream>,
    Error = io::Error,
    Future = impl Future<Output = io::Result<TokioIo<GrpcGoStream>>> + Send,
> + Clone
       + Send
       + 'static {
    let path = path.to_path_buf();
    let authority = match dial {
        Dial::RawPath => Some(encode_authority(&path.to_string_lossy()).into_bytes()),
        Dial::UnixScheme => None,
    };
    tower::service_fn(move |_: tonic::transport::Uri| {
        let path = path.clone();
        let authority = authority.clone();
        async move {
            let stream = UnixStream::connect(path).await?;
            Ok::<_, io::Error>(TokioIo::new(GrpcGoStream::new(stream, authority)))
        }
    })
}

/// A client connection whose outgoing header blocks carry `authority` (when set) as `:authority`.
pub struct GrpcGoStream {
    inner: UnixStream,
    rewriter: Option<AuthorityRewriter>,
    /// Rewritten bytes not yet written to the socket.
    pending: Vec<u8>,
    pending_at: usize,
}

impl GrpcGoStream {
    fn new(inner: UnixStream, authority: Option<Vec<u8>>) -> Self {
        let rewriter = authority.map(|authority| {
            AuthorityRewriter::new(Arc::new(move |_: &[u8]| Some(authority.clone())))
        });
        GrpcGoStream {
            inner,
            rewriter,
            pending: Vec::new(),
            pending_at: 0,
        }
    }

    /// Writes out what the rewriter produced; Pending until all of it is on the socket.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.pending_at < self.pending.len() {
            let written =
                ready!(Pin::new(&mut self.inner).poll_write(cx, &self.pending[self.pending_at..]))?;
            if written == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.pending_at += written;
        }
        self.pending.clear();
        self.pending_at = 0;
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for GrpcGoStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for GrpcGoStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.rewriter.is_none() {
            return Pin::new(&mut this.inner).poll_write(cx, buf);
        }
        ready!(this.poll_drain(cx))?;
        if let Some(rewriter) = this.rewriter.as_mut() {
            rewriter.feed(buf, &mut this.pending);
        }
        // The bytes are taken; a write that cannot finish now completes in the next write or flush.
        if let Poll::Ready(Err(error)) = this.poll_drain(cx) {
            return Poll::Ready(Err(error));
        }
        Poll::Ready(Ok(buf.len()))
    }

    /// Without a rewriter, writes go out as the client batched them (one writev for a request's HEADERS
    /// and DATA, as grpc-go's buffered writer does); a stream that cannot take them so would wake the
    /// server once per frame and make the plugin look slower than it is.
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.rewriter.is_none() {
            return Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        }
        let first = bufs
            .iter()
            .find(|b| !b.is_empty())
            .map_or(&[][..], |b| &**b);
        Pin::new(this).poll_write(cx, first)
    }

    fn is_write_vectored(&self) -> bool {
        self.rewriter.is_none() && self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}
