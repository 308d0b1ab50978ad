use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A TCP proxy on `127.0.0.1:0` in front of a real server, for crash and outage tests: while
/// cut, it closes every open connection and refuses new ones (accepts and drops them at
/// once), as a dead database or broker would look to a client.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    generation: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
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
        let task = {
            let cut = cut.clone();
            let generation = generation.clone();
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
                    tokio::spawn(async move {
                        let Ok(mut server) = TcpStream::connect(target).await else {
                            return;
                        };
                        let mut client = client;
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                            _ = cut_rx.changed() => {}
                        }
                    });
                }
            })
        };
        Self {
            addr,
            cut,
            generation,
            task,
        }
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

    /// Lets connections through again.
    pub fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
