//! Errors told whole: an error and its causes on one line, for logs and
//! messages; and the words of a login refused for want of channel binding,
//! which both Postgres connections and [`Chain`] use.

/// An error with its causes, for logs and messages.
///
/// tokio-postgres prints a server error as just "db error" and keeps the
/// server's message in the source; this prints `ERROR: must be owner of …`.
/// Its refusal under `channel_binding = require` comes out in the words the
/// replication connection uses ([`channel_binding_refused`]).
pub struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut text = String::new();
        let mut next = Some(self.0);
        while let Some(error) = next {
            // The replication connection refuses in libpq's words; so does this one.
            let refusal = error
                .downcast_ref::<tokio_postgres::Error>()
                .is_some_and(is_channel_binding_refusal);
            let more = if refusal {
                channel_binding_refused(None)
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

/// What libpq's words call channel binding refused: the same sentence on both
/// connections (tokio-postgres's own, "server did not use channel binding",
/// is translated to it, see [`is_channel_binding_refusal`]).
pub const CHANNEL_BINDING_NOT_OFFERED: &str = "channel binding is required, but server did not offer an authentication method that supports channel binding";

/// The whole message of a refusal under `channel_binding = require`; `detail`
/// says what the server did, when the relay knows.
pub(crate) fn channel_binding_refused(detail: Option<&str>) -> String {
    let detail = detail.map(|d| format!(" ({d})")).unwrap_or_default();
    format!(
        "{CHANNEL_BINDING_NOT_OFFERED}{detail}; postgres.channel_binding = require needs the \
         relay's role to log in by scram-sha-256 over TLS (a hostssl line in pg_hba.conf, the \
         password stored as SCRAM): fix the server, or set channel_binding = prefer"
    )
}

/// Whether tokio-postgres refused to log in because `channel_binding =
/// require` was not met. tokio-postgres has no error kind for it; its text is
/// pinned by the channel-binding end-to-end tests, which fail if it changes.
pub(crate) fn is_channel_binding_refusal(error: &tokio_postgres::Error) -> bool {
    std::error::Error::source(error)
        .is_some_and(|cause| cause.to_string() == "server did not use channel binding")
}
