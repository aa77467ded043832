//! Outbox rows read with SQL, made into messages: the poller's and replay's
//! way in, through the same mapping as the stream and the same
//! [`Outgoing`] step (filter, routing, envelope).
//!
//! Rows are selected with every column cast to text (see
//! [`Table::text_columns`]) under the session settings the replication
//! connection uses (`TimeZone = UTC`, ISO dates, hex bytea), so a row read here
//! becomes exactly the envelope the stream would have made of it.

use bytes::Bytes;
use tokio_postgres::Row;

use crate::config::Config;
use crate::event::{MappingError, RowMapping, TextRow};
use crate::pipeline::ack::Ticket;
use crate::pipeline::outgoing::Outgoing;
pub(crate) use crate::pipeline::outgoing::Prepared;
use crate::pipeline::sink::Message;
use crate::postgres::outbox::table::Table;

/// Session settings that make `::text` print values as pgoutput does.
pub(crate) const TEXT_SETTINGS: &str = "SET LOCAL TimeZone = 'UTC'; SET LOCAL DateStyle = 'ISO'; \
     SET LOCAL bytea_output = 'hex'; SET LOCAL extra_float_digits = 3";

/// Turns rows of the outbox table into messages.
pub(crate) struct Rows {
    mapping: RowMapping,
    outgoing: Outgoing,
    width: usize,
}

impl Rows {
    /// For `table` of `database`, configured by `config`.
    pub(crate) fn new(
        config: &Config,
        table: &Table,
        database: &str,
    ) -> Result<Self, MappingError> {
        let described: Vec<(&str, u32)> = table
            .columns
            .iter()
            .map(|(n, t)| (n.as_str(), *t))
            .collect();
        Ok(Self {
            mapping: RowMapping::from_columns(&table.qualified, &described, &config.columns)?,
            outgoing: Outgoing::new(config, database),
            width: table.columns.len(),
        })
    }

    /// How many leading columns of a selected row are the table's.
    pub(crate) fn width(&self) -> usize {
        self.width
    }

    /// Make a message of `row`, whose first [`Rows::width`] columns are the
    /// table's, as text.
    pub(crate) fn prepare(&mut self, row: &Row) -> Prepared {
        let values = TextRow(
            (0..self.width)
                .map(|i| {
                    row.get::<_, Option<&str>>(i)
                        .map(|s| Bytes::copy_from_slice(s.as_bytes()))
                })
                .collect(),
        );
        match self.mapping.event(&values, 0) {
            Ok(event) => self.outgoing.prepare(event, Ticket::detached(), 0),
            Err(e) => Prepared::Fail(
                self.mapping.id_of(&values).unwrap_or_default(),
                e.to_string(),
            ),
        }
    }
}

/// Split `messages` into runs of one destination of at most `max` each, in order.
pub(crate) fn batches(messages: &[Message], max: usize) -> Vec<&[Message]> {
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
