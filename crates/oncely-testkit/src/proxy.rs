use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};

/// A TCP proxy on `127.0.0.1:0` in front of a real server, for crash and outage tests: while
/// cut, it closes every open connection and refuses new ones (accepts and drops them at
/// once), as a dead database or broker would look to a client; while frozen, it forwards
/// nothing in either direction but keeps every connection open, as a silent partition (a
/// crashed host, a dropped route) looks to both sides.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    generation: watch::Sender<u64>,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

/// What [`FaultProxy::fault_when_sent`] does to the connection that sent the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// Close that connection (both sides) without forwarding the bytes.
    Cut,
    /// Hold the bytes and stop forwarding on that connection in both directions, keeping
    /// both sides open, until [`FaultProxy::restore`].
    Freeze,
}

/// State shared by the proxy handle and its connections.
#[derive(Debug)]
struct Shared {
    /// `(frozen, thaws)`: the global freeze, and how many times [`FaultProxy::restore`] ran
    /// (a connection frozen by a trigger flows again once this moves past its mark).
    flow: watch::Sender<(bool, u64)>,
    trigger: Mutex<Option<(Vec<u8>, Fault)>>,
    hits: AtomicUsize,
}

/// One proxied connection.
struct Conn {
    shared: Arc<Shared>,
    /// `thaws` when a trigger froze this connection, `u64::MAX` when it did not.
    frozen_at: AtomicU64,
    cut: Notify,
}

impl Conn {
    /// Returns once bytes may be forwarded.
    async fn flowing(&self) {
        let mut rx = self.shared.flow.subscribe();
        loop {
            let (frozen, thaws) = *rx.borrow_and_update();
            if !frozen && self.frozen_at.load(Ordering::SeqCst) != thaws {
                return;
            }
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// The armed fault, if the client's bytes `chunk` (after `tail`, the end of the previous
    /// chunk) contain its needle.
    fn triggered(&self, tail: &mut Vec<u8>, chunk: &[u8]) -> Option<Fault> {
        let guard = self.shared.trigger.lock().expect("trigger lock");
        let (needle, fault) = guard.as_ref()?;
        tail.extend_from_slice(chunk);
        let hit = tail.windows(needle.len()).any(|w| w == needle.as_slice());
        let keep = needle.len().saturating_sub(1).min(tail.len());
        tail.drain(..tail.len() - keep);
        hit.then(|| {
            self.shared.hits.fetch_add(1, Ordering::SeqCst);
            *fault
        })
    }

    /// Forwards `from` to `to` while flowing; `inspect`: the client's direction, where the
    /// armed trigger is looked for.
    async fn pump(&self, mut from: OwnedReadHalf, mut to: OwnedWriteHalf, inspect: bool) {
        let mut buf = vec![0_u8; 16 * 1024];
        let mut tail = Vec::new();
        loop {
            self.flowing().await;
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if inspect {
                match self.triggered(&mut tail, &buf[..n]) {
                    Some(Fault::Cut) => {
                        self.cut.notify_one();
                        std::future::pending::<()>().await;
                    }
                    Some(Fault::Freeze) => {
                        let thaws = self.shared.flow.borrow().1;
                        self.frozen_at.store(thaws, Ordering::SeqCst);
                    }
                    None => {}
                }
            }
            self.flowing().await;
            if to.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        drop(to.shutdown().await);
    }
}

impl FaultProxy {
    /// Starts a proxy forwarding to `target`.
    ///
    /// # Panics
    /// When no local port can be bound.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let cut = Arc::new(AtomicBool::new(false));
        let (generation, _) = watch::channel(0_u64);
        let shared = Arc::new(Shared {
            flow: watch::channel((false, 0)).0,
            trigger: Mutex::new(None),
            hits: AtomicUsize::new(0),
        });
        let task = {
            let cut = cut.clone();
            let generation = generation.clone();
            let shared = shared.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        continue;
                    };
                    // Subscribe before looking at `cut`: a cut between the two would
                    // otherwise count as already seen, and this connection would survive it.
                    let mut cut_rx = generation.subscribe();
                    if cut.load(Ordering::SeqCst) {
                        drop(client);
                        continue;
                    }
                    let conn = Conn {
                        shared: shared.clone(),
                        frozen_at: AtomicU64::new(u64::MAX),
                        cut: Notify::new(),
                    };
                    tokio::spawn(async move {
                        let Ok(server) = TcpStream::connect(target).await else {
                            return;
                        };
                        let (client_read, client_write) = client.into_split();
                        let (server_read, server_write) = server.into_split();
                        let both = async {
                            tokio::join!(
                                conn.pump(client_read, server_write, true),
                                conn.pump(server_read, client_write, false)
                            )
                        };
                        tokio::select! {
                            _ = both => {}
                            _ = cut_rx.changed() => {}
                            () = conn.cut.notified() => {}
                        }
                    });
                }
            })
        };
        Self {
            addr,
            cut,
            generation,
            shared,
            task,
        }
    }

    /// Starts a proxy in front of the server `url` names (`scheme://[user@]host:port/…`)
    /// and returns it with `url` pointed at the proxy (same path, user and query).
    ///
    /// # Panics
    /// When `url` has no `host:port` that resolves, or no local port can be bound.
    pub async fn in_front_of(url: &str) -> (Self, String) {
        let authority = crate::url_authority(url).expect("a URL with host:port");
        let target = tokio::net::lookup_host(authority.as_str())
            .await
            .expect("resolve the server")
            .next()
            .expect("an address for the server");
        let proxy = Self::start(target).await;
        let proxied = url.replacen(&authority, &proxy.addr().to_string(), 1);
        (proxy, proxied)
    }

    /// The proxy's address; point the client here.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes every open connection and refuses new ones until [`FaultProxy::restore`].
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        self.generation.send_modify(|g| *g += 1);
    }

    /// Stops forwarding bytes in both directions on every connection, open or new, while
    /// keeping them open (neither side sees a close or a reset), until
    /// [`FaultProxy::restore`].
    pub fn freeze(&self) {
        self.shared.flow.send_modify(|(frozen, _)| *frozen = true);
    }

    /// Arms a fault at an exact point of a protocol: the first time a connection's client
    /// sends bytes containing `needle` (e.g. the text of one SQL statement), `fault` is
    /// applied to that connection, before the bytes are forwarded. Other connections are
    /// untouched. Stays armed for every connection until [`FaultProxy::restore`].
    ///
    /// Database drivers send a statement's text only when they prepare it: with a statement
    /// cache, once per connection (sqlx: `statement-cache-capacity=0` in the URL sends it
    /// every time).
    ///
    /// # Panics
    /// When `needle` is empty.
    pub fn fault_when_sent(&self, needle: impl Into<Vec<u8>>, fault: Fault) {
        let needle = needle.into();
        assert!(!needle.is_empty(), "an empty needle matches everything");
        *self.shared.trigger.lock().expect("trigger lock") = Some((needle, fault));
    }

    /// How many connections an armed [`FaultProxy::fault_when_sent`] has hit so far.
    pub fn faults_applied(&self) -> usize {
        self.shared.hits.load(Ordering::SeqCst)
    }

    /// Lets connections through again: ends a cut (new connections are accepted; cut ones
    /// stay closed) and a freeze (frozen connections forward what they held), and disarms
    /// [`FaultProxy::fault_when_sent`].
    pub fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
        *self.shared.trigger.lock().expect("trigger lock") = None;
        self.shared
            .flow
            .send_modify(|(frozen, thaws)| (*frozen, *thaws) = (false, *thaws + 1));
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `url` (a sqlx database URL) with the driver's statement cache off
/// (`statement-cache-capacity=0`), so every statement's text crosses the wire each time it
/// runs and [`FaultProxy::fault_when_sent`] sees it on every connection.
pub fn without_statement_cache(url: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}statement-cache-capacity=0")
}
