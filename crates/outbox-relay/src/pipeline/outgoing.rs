//! From an [`OutboxEvent`] to a [`Message`]: filter, route, encode. The one
//! way out for the stream, the poller and replay, so an event becomes the same
//! message whichever path it takes.

use bytes::Bytes;

use crate::config::{Config, FilterConfig};
use crate::event::OutboxEvent;
use crate::pipeline::ack::Ticket;
use crate::pipeline::envelope::Encoder;
use crate::pipeline::route::Router;
use crate::pipeline::sink::Message;

/// What became of one event.
#[derive(Debug)]
pub(crate) enum Prepared {
    /// Ready to publish.
    Publish(Message),
    /// Filtered out (`[filter]`): its id.
    Skip(String),
    /// Cannot be published: its id and why.
    Fail(String, String),
}

/// Filter, router and encoder of one relay.
pub(crate) struct Outgoing {
    encoder: Encoder,
    router: Router,
    filter: FilterConfig,
}

impl Outgoing {
    /// For `config`, on `database` (the default CloudEvents source names it).
    pub(crate) fn new(config: &Config, database: &str) -> Self {
        let source = config
            .envelope
            .source
            .clone()
            .unwrap_or_else(|| Encoder::default_source(database, &config.table()));
        Self {
            encoder: Encoder::new(config.envelope.format, &source),
            router: Router::new(config.destination().routes()),
            filter: config.filter.clone(),
        }
    }

    /// Make `event` (committed at `commit_time`, 0 when unknown) a message
    /// carrying `ticket`, or say why not.
    pub(crate) fn prepare(
        &mut self,
        event: OutboxEvent,
        ticket: Ticket,
        commit_time: i64,
    ) -> Prepared {
        if !self
            .filter
            .admits(event.event_type(), event.aggregate_type())
        {
            return Prepared::Skip(event.id().to_owned());
        }
        let destination = match self.router.route(&event) {
            Ok(d) => d,
            Err(reason) => return Prepared::Fail(event.id().to_string(), reason),
        };
        let mut body = Vec::new();
        self.encoder.encode(&event, &mut body);
        Prepared::Publish(Message {
            ticket,
            event: Box::new(event),
            // A boxed slice becomes `Bytes` without a second allocation (a
            // `Vec` with spare room needs a shared header); shrinking the
            // envelope's few spare bytes reallocates in place.
            body: Bytes::from(body.into_boxed_slice()),
            destination,
            commit_time,
        })
    }
}
