//! Outbox rows read with SQL, made into messages: the poller's and replay's
//! way in, through the same mapping, filter, routing and envelope as the stream.
//!
//! Rows are selected with every column cast to text (see
//! [`Table::text_columns`]) under the session settings the replication
//! connection uses (`TimeZone = UTC`, ISO dates, hex bytea), so a row read here
//! becomes exactly the envelope the stream would have made of it.

use bytes::Bytes;
use tokio_postgres::Row;

use crate::ack::Ticket;
use crate::config::{Config, SinkKind};
use crate::envelope::Encoder;
use crate::event::{MappingError, RowMapping, TextRow};
use crate::route::Router;
use crate::sink::Message;
use crate::table::Table;

/// Session settings that make `::text` print values as pgoutput does.
pub const TEXT_SETTINGS: &str = "SET LOCAL TimeZone = 'UTC'; SET LOCAL DateStyle = 'ISO'; \
     SET LOCAL bytea_output = 'hex'; SET LOCAL extra_float_digits = 3";

/// What became of one row.
// `Publish` is the common case; boxing it would add an allocation per row.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Prepared {
    /// Ready to publish.
    Publish(Message),
    /// Filtered out (`[filter]`): its id.
    Skip(String),
    /// Cannot be published: its id and why.
    Fail(String, String),
}

/// Turns rows of the outbox table into messages.
pub struct Rows {
    mapping: RowMapping,
    encoder: Encoder,
    router: Router,
    config: Config,
    width: usize,
}

impl Rows {
    /// For `table` of `database`, configured by `config`.
    pub fn new(config: &Config, table: &Table, database: &str) -> Result<Self, MappingError> {
        let described: Vec<(&str, u32)> = table
            .columns
            .iter()
            .map(|(n, t)| (n.as_str(), *t))
            .collect();
        let mapping = RowMapping::from_columns(&table.qualified, &described, &config.columns)?;
        let source = config
            .envelope
            .source
            .clone()
            .unwrap_or_else(|| Encoder::default_source(database, &config.table()));
        Ok(Self {
            mapping,
            encoder: Encoder::new(config.envelope.format, &source),
            router: match config.sink.kind {
                SinkKind::Sns => Router::sns(&config.sns),
                SinkKind::Stdout => Router::single(),
            },
            config: config.clone(),
            width: table.columns.len(),
        })
    }

    /// How many leading columns of a selected row are the table's.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Make a message of `row`, whose first [`Rows::width`] columns are the
    /// table's, as text.
    pub fn prepare(&mut self, row: &Row) -> Prepared {
        let values = TextRow(
            (0..self.width)
                .map(|i| {
                    row.get::<_, Option<&str>>(i)
                        .map(|s| Bytes::copy_from_slice(s.as_bytes()))
                })
                .collect(),
        );
        let id = self.mapping.id_of(&values).unwrap_or_default();
        let event = match self.mapping.event(&values, 0) {
            Ok(event) => event,
            Err(e) => return Prepared::Fail(id, e.to_string()),
        };
        if !self
            .config
            .filter
            .admits(event.event_type.as_str(), event.aggregate_type.as_str())
        {
            return Prepared::Skip(id);
        }
        let destination = match self.router.route(&event) {
            Ok(d) => d,
            Err(reason) => return Prepared::Fail(id, reason),
        };
        let mut body = Vec::new();
        self.encoder.encode(&event, &mut body);
        Prepared::Publish(Message {
            ticket: Ticket::detached(),
            event,
            body: Bytes::from(body),
            destination,
            commit_time: 0,
        })
    }
}

/// Split `messages` into runs of one destination of at most `max` each, in order.
pub fn batches(messages: &[Message], max: usize) -> Vec<&[Message]> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=messages.len() {
        if i == messages.len()
            || i - start >= max
            || messages[i].destination != messages[start].destination
        {
            if i > start {
                out.push(&messages[start..i]);
            }
            start = i;
        }
    }
    out
}
