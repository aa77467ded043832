//! The publish calls of the four AWS protocols the relay speaks, as the fault
//! proxy needs them: which events a call carries, how to take one entry out
//! of it, and how to put that entry back into the answer as a failure at its
//! position (SNS `PublishBatch` and SQS `SendMessageBatch` name failures by
//! entry id; EventBridge `PutEvents` and Kinesis `PutRecords` answer one
//! result per entry, in order).

use base64::Engine as _;
use serde_json::{json, Value};

/// The calls that carry events.
pub(super) fn is_publish(action: &str) -> bool {
    matches!(
        action,
        "Publish"
            | "PublishBatch"
            | "SendMessage"
            | "SendMessageBatch"
            | "PutEvents"
            | "PutRecords"
    )
}

/// The error code a destination answers when its quota is exceeded (HTTP 400).
pub(super) fn throttling_code(action: &str) -> &'static str {
    match action {
        "Publish" | "PublishBatch" => "Throttling",
        "PutRecords" => "ProvisionedThroughputExceededException",
        _ => "ThrottlingException",
    }
}

/// The envelope ids (`"id"` of the CloudEvent) of the events a publish call
/// carries, in entry order; an entry whose body is not an envelope counts as
/// `"?"`.
pub(super) fn event_ids(action: &str, body: &[u8]) -> Vec<String> {
    bodies(action, body)
        .iter()
        .map(|b| {
            serde_json::from_slice::<Value>(b)
                .ok()
                .and_then(|v| v["id"].as_str().map(ToOwned::to_owned))
                .unwrap_or_else(|| "?".to_owned())
        })
        .collect()
}

/// Whether the call's body, or the message body of one of its entries
/// (Kinesis records are base64), holds `marker`.
pub(super) fn carries(action: &str, body: &[u8], marker: &str) -> bool {
    let holds = |b: &[u8]| b.windows(marker.len()).any(|w| w == marker.as_bytes());
    !marker.is_empty() && (holds(body) || bodies(action, body).iter().any(|b| holds(b)))
}

/// The message body of each entry.
fn bodies(action: &str, body: &[u8]) -> Vec<Vec<u8>> {
    match action {
        "PublishBatch" => members(body)
            .1
            .into_iter()
            .filter_map(|fields| {
                fields
                    .into_iter()
                    .find(|(f, _)| f == "Message")
                    .map(|(_, v)| percent_decode(&v))
            })
            .collect(),
        "Publish" => form(body)
            .into_iter()
            .find(|(k, _)| k == "Message")
            .map(|(_, v)| vec![percent_decode(&v)])
            .unwrap_or_default(),
        _ => {
            let Ok(v) = serde_json::from_slice::<Value>(body) else {
                return Vec::new();
            };
            let (list, field) = json_list(action);
            let one = |e: &Value| -> Option<Vec<u8>> {
                let text = e[field].as_str()?;
                if action == "PutRecords" {
                    base64::engine::general_purpose::STANDARD.decode(text).ok()
                } else {
                    Some(text.as_bytes().to_vec())
                }
            };
            match v[list].as_array() {
                Some(entries) => entries.iter().filter_map(one).collect(),
                None => one(&v).into_iter().collect(), // SendMessage
            }
        }
    }
}

/// Where a JSON call lists its entries, and the field with each body.
fn json_list(action: &str) -> (&'static str, &'static str) {
    match action {
        "PutEvents" => ("Entries", "Detail"),
        "PutRecords" => ("Records", "Data"),
        _ => ("Entries", "MessageBody"),
    }
}

/// A batch call with one entry taken out.
pub(super) struct Without {
    /// The call's body without the entry (`None`: no entry is left).
    pub rest: Option<Vec<u8>>,
    /// The entry's position in the call.
    pub position: usize,
    /// The entry's own id in the call (SNS, SQS), which the answer names.
    pub entry_id: String,
}

/// `body` without the entry at `position` (modulo the number of entries);
/// `None` when the call is not a batch call or has no entries.
pub(super) fn without_entry(action: &str, body: &[u8], position: usize) -> Option<Without> {
    if action == "PublishBatch" {
        const MEMBER: &str = "PublishBatchRequestEntries.member.";
        let (others, entries) = members(body);
        if entries.is_empty() {
            return None;
        }
        let position = position % entries.len();
        let entry_id = entries[position]
            .iter()
            .find(|(f, _)| f == "Id")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        let mut out: Vec<String> = others
            .into_iter()
            .map(|(k, v)| if v.is_empty() { k } else { format!("{k}={v}") })
            .collect();
        for (n, fields) in entries
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != position)
            .map(|(_, f)| f)
            .enumerate()
        {
            for (field, value) in fields {
                out.push(format!("{MEMBER}{}.{field}={value}", n + 1));
            }
        }
        let rest = (entries.len() > 1).then(|| out.join("&").into_bytes());
        return Some(Without {
            rest,
            position,
            entry_id,
        });
    }
    if !matches!(action, "SendMessageBatch" | "PutEvents" | "PutRecords") {
        return None;
    }
    let mut v: Value = serde_json::from_slice(body).ok()?;
    let (list, _) = json_list(action);
    let entries = v[list].as_array_mut()?;
    if entries.is_empty() {
        return None;
    }
    let position = position % entries.len();
    let removed = entries.remove(position);
    let entry_id = removed["Id"].as_str().unwrap_or_default().to_owned();
    let rest = (!entries.is_empty()).then(|| v.to_string().into_bytes());
    Some(Without {
        rest,
        position,
        entry_id,
    })
}

/// The body of a successful answer to the call with `without`'s entry put
/// back as a transient failure of that entry (`answer`: the destination's
/// answer to the rest, `None` when nothing was left to send).
pub(super) fn with_failed_entry(action: &str, answer: Option<&[u8]>, without: &Without) -> Vec<u8> {
    const WHY: &str = "failed by the fault proxy";
    if action == "PublishBatch" {
        let body = answer.map_or_else(
            || {
                "<PublishBatchResponse><PublishBatchResult><Successful/></PublishBatchResult>\
                 <ResponseMetadata><RequestId>r</RequestId></ResponseMetadata></PublishBatchResponse>"
                    .to_owned()
            },
            |a| String::from_utf8_lossy(a).into_owned(),
        );
        let failed = format!(
            "<Failed><member><Id>{}</Id><Code>InternalError</Code><Message>{WHY}</Message>\
             <SenderFault>false</SenderFault></member></Failed>",
            without.entry_id
        );
        return body
            .replacen(
                "<PublishBatchResult>",
                &format!("<PublishBatchResult>{failed}"),
                1,
            )
            .into_bytes();
    }
    let mut v: Value = answer
        .and_then(|a| serde_json::from_slice(a).ok())
        .unwrap_or_else(|| match action {
            "SendMessageBatch" => json!({"Successful": [], "Failed": []}),
            "PutEvents" => json!({"FailedEntryCount": 0, "Entries": []}),
            _ => json!({"FailedRecordCount": 0, "Records": []}),
        });
    match action {
        "SendMessageBatch" => {
            if !v["Failed"].is_array() {
                v["Failed"] = json!([]);
            }
            if let Some(failed) = v["Failed"].as_array_mut() {
                failed.push(json!({
                    "Id": without.entry_id,
                    "Code": "InternalError",
                    "SenderFault": false,
                    "Message": WHY,
                }));
            }
        }
        _ => {
            let (list, count, code) = if action == "PutEvents" {
                ("Entries", "FailedEntryCount", "InternalFailure")
            } else {
                (
                    "Records",
                    "FailedRecordCount",
                    "ProvisionedThroughputExceededException",
                )
            };
            let n = v[count].as_u64().unwrap_or(0) + 1;
            v[count] = json!(n);
            if !v[list].is_array() {
                v[list] = json!([]);
            }
            if let Some(results) = v[list].as_array_mut() {
                let at = without.position.min(results.len());
                results.insert(at, json!({"ErrorCode": code, "ErrorMessage": WHY}));
            }
        }
    }
    v.to_string().into_bytes()
}

/// A form body's pairs (still percent-encoded).
fn form(body: &[u8]) -> Vec<(String, String)> {
    String::from_utf8_lossy(body)
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (k.to_owned(), v.to_owned())
        })
        .collect()
}

/// A `PublishBatch` body: the pairs that are not entries, and each entry's
/// `(field, value)` pairs in member order.
#[allow(clippy::type_complexity)]
fn members(body: &[u8]) -> (Vec<(String, String)>, Vec<Vec<(String, String)>>) {
    const MEMBER: &str = "PublishBatchRequestEntries.member.";
    let mut others = Vec::new();
    let mut entries: std::collections::BTreeMap<u32, Vec<(String, String)>> =
        std::collections::BTreeMap::new();
    for (key, value) in form(body) {
        match key
            .strip_prefix(MEMBER)
            .and_then(|rest| rest.split_once('.'))
            .and_then(|(n, field)| Some((n.parse::<u32>().ok()?, field.to_owned())))
        {
            Some((n, field)) => entries.entry(n).or_default().push((field, value)),
            None => others.push((key, value)),
        }
    }
    (others, entries.into_values().collect())
}

/// A form value decoded (`%XX`, and `+` as a space).
fn percent_decode(text: &str) -> Vec<u8> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = |b: u8| (b as char).to_digit(16);
                match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                    (Some(hi), Some(lo)) => {
                        out.push(u8::try_from(hi * 16 + lo).unwrap_or(b'?'));
                        i += 2;
                    }
                    _ => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_publish_batch_loses_the_entry_at_a_position_and_its_failure_is_answered_by_id() {
        let body = b"Action=PublishBatch&TopicArn=t\
            &PublishBatchRequestEntries.member.1.Id=0\
            &PublishBatchRequestEntries.member.1.Message=%7B%22id%22%3A%22a%22%7D\
            &PublishBatchRequestEntries.member.2.Id=1\
            &PublishBatchRequestEntries.member.2.Message=%7B%22id%22%3A%22b%22%7D";
        assert_eq!(event_ids("PublishBatch", body), ["a", "b"]);
        let w = without_entry("PublishBatch", body, 2).unwrap();
        assert_eq!((w.position, w.entry_id.as_str()), (0, "0"));
        let rest = w.rest.clone().unwrap();
        assert_eq!(event_ids("PublishBatch", &rest), ["b"]);
        assert!(String::from_utf8_lossy(&rest).contains("member.1.Id=1"));
        let answer = with_failed_entry("PublishBatch", None, &w);
        assert!(String::from_utf8_lossy(&answer).contains("<Id>0</Id><Code>InternalError</Code>"));
    }

    #[test]
    fn put_records_answers_the_failure_at_the_entrys_position() {
        let data = |id: &str| {
            base64::engine::general_purpose::STANDARD.encode(format!("{{\"id\":\"{id}\"}}"))
        };
        let body = json!({"StreamName": "s", "Records": [
            {"Data": data("a"), "PartitionKey": "1"},
            {"Data": data("b"), "PartitionKey": "2"},
            {"Data": data("c"), "PartitionKey": "3"},
        ]})
        .to_string();
        assert_eq!(event_ids("PutRecords", body.as_bytes()), ["a", "b", "c"]);
        let w = without_entry("PutRecords", body.as_bytes(), 1).unwrap();
        assert_eq!(
            event_ids("PutRecords", w.rest.as_ref().unwrap()),
            ["a", "c"]
        );
        let answer = json!({"FailedRecordCount": 0, "Records": [
            {"SequenceNumber": "1", "ShardId": "s0"}, {"SequenceNumber": "2", "ShardId": "s0"}
        ]})
        .to_string();
        let out: Value = serde_json::from_slice(&with_failed_entry(
            "PutRecords",
            Some(answer.as_bytes()),
            &w,
        ))
        .unwrap();
        assert_eq!(out["FailedRecordCount"], 1);
        assert_eq!(
            out["Records"][1]["ErrorCode"],
            "ProvisionedThroughputExceededException"
        );
        assert_eq!(out["Records"][2]["SequenceNumber"], "2");
    }
}
