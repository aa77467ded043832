-- outbox-relay 005: where rejected events are recorded when the outbox table
-- has no publish_state / last_error / attempts columns (an application-managed
-- or Debezium-style table). With the default table, rejected rows are marked
-- FAILED in place instead and this table stays empty.
CREATE TABLE IF NOT EXISTS {{schema}}.{{dead_letter}} (
    event_id   text        NOT NULL,
    event_type text,
    aggregate_type text,
    aggregate_id   text,
    envelope   text,
    reason     text        NOT NULL,
    failed_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS {{dead_letter_index}} ON {{schema}}.{{dead_letter}} (failed_at);
GRANT SELECT, INSERT, DELETE ON {{schema}}.{{dead_letter}} TO {{role}};
