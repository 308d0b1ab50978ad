//! An error and its causes, as one line.

/// `error` and its sources as one line, `outer: inner: root`, leaving out a source whose
/// text the line already holds (errors that embed their cause in their own message, as
/// `thiserror`'s `{0}` does, would otherwise say it twice), so the root cause ("connection
/// refused") is there once. For logs and evidence.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut line = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        source = s.source();
    }
    line
}

#[cfg(test)]
mod tests {
    use super::error_chain;

    #[derive(Debug, thiserror::Error)]
    #[error("outer: {0}")]
    struct Outer(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("wrapped")]
    struct Wrapped(#[source] std::io::Error);

    #[test]
    fn error_chain_keeps_the_root_cause_once() {
        let refused = || std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert_eq!(error_chain(&Outer(refused())), "outer: refused");
        assert_eq!(error_chain(&Wrapped(refused())), "wrapped: refused");
    }
}
