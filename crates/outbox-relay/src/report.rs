//! Errors told whole: an error and its causes on one line, for logs and
//! messages.

/// An error with its causes, for logs and messages.
///
/// tokio-postgres prints a server error as just "db error" and keeps the
/// server's message in the source; this prints `ERROR: must be owner of …`.
/// Its refusal under `channel_binding = require` comes out in the words the
/// replication connection uses ([`crate::postgres::tls::channel_binding_refused`]).
pub struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut text = String::new();
        let mut next = Some(self.0);
        while let Some(error) = next {
            // The replication connection refuses in libpq's words; so does this one.
            let refusal = error
                .downcast_ref::<tokio_postgres::Error>()
                .is_some_and(crate::postgres::tls::is_channel_binding_refusal);
            let more = if refusal {
                crate::postgres::tls::channel_binding_refused(None)
            } else {
                error.to_string()
            };
            if !text.contains(&more) {
                if !text.is_empty() {
                    text.push_str(": ");
                }
                text.push_str(&more);
            }
            next = if refusal { None } else { error.source() };
        }
        f.write_str(&text)
    }
}
