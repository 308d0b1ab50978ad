//! [`bind`]: a command's listen address, with a port in use refused in words.

use std::io;
use std::net::SocketAddr;

/// Binds `addr`, the value the command's flag `flag` (e.g. `--listen`) gave.
///
/// # Errors
/// The port is in use: the message names the port and the flag that changes it. Any other
/// failure to bind: the operating system's error, with the address and the flag.
pub async fn bind(addr: SocketAddr, flag: &str) -> anyhow::Result<tokio::net::TcpListener> {
    match tokio::net::TcpListener::bind(addr).await {
        Ok(listener) => Ok(listener),
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => Err(anyhow::anyhow!(
            "port {} is in use; pass {flag} with another address ({flag} {}:0 takes any free port)",
            addr.port(),
            addr.ip()
        )),
        Err(e) => Err(anyhow::Error::new(e).context(format!("binding {addr} ({flag})"))),
    }
}
