//! The outbox table's SQL, in one home: its shape ([`table`]), the state
//! derived from a vouched snapshot ([`derived`]), marking rows published
//! ([`marking`]), recording rows failed ([`record`]) and deleting
//! what is done ([`retention`]).

pub(crate) mod derived;
pub(crate) mod marking;
pub(crate) mod record;
pub(crate) mod retention;
pub(crate) mod table;
