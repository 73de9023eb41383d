//! Flight records as JSON: written for files and other tools, read back for the analyser.
//!
//! The shape, one object per record (field names are the struct's):
//!
//! ```text
//! { "format": "nccl-rs flight record 1", "rank": 1, "size": 4, "device": 1, "name": null,
//!   "pid": 4242, "serial": 1, "capacity": 1024, "recorded": 5, "collectives": 5, "completed_through": 2,
//!   "taken_at_us": 1767225600000000, "reason": "...",
//!   "entries": [ { "seq": 1, "collective_seq": 1, "kind": "AllReduce", "dtype": "ncclFloat32",
//!                  "count": 1024, "root": null, "peer": null, "reduction": "sum",
//!                  "stream": 94000000, "group": null, "enqueued_at_us": 1767225599000000,
//!                  "state": "completed", "shipped": null, "replay": null,
//!                  "captured_in": null }, ... ],
//!   "shipped": [], "graphs": [], "shipped_created": 0, "graphs_recorded": 0 }
//! ```
//!
//! A launch of a shipped kernel has `"shipped": { "instance": 1, "seq": 3, "kernel":
//! "one-shot-flags" }` (`seq` null where the launch failed), and the record's `"shipped"`
//! lists the instances' counters: `{ "instance": 1, "calls": 3, "ended": "gave up" (or
//! "stopped", or null), "ended_after": 3 (or null), "dropped": false }`. Both are optional
//! when read, so records written before shipped kernels were recorded read as before; a
//! reader from before them refuses a record holding a shipped call (its kind is unknown
//! there) and reads any other.
//!
//! A CUDA graph's replay has `"replay": { "graph": 2, "seq": 117 }` (`seq` null where the
//! launch failed), an operation a recorded graph captured `"captured_in": 2`, and the
//! record's `"graphs"` lists the graphs' counters: `{ "graph": 2, "captured_from": 12,
//! "captured_through": 40, "stream": 94000000, "operations": 14, "collectives": 12,
//! "replays": 117, "dropped": false }`. All three are optional when read (records written
//! before graphs were recorded read with none), and none changes what another field means,
//! so [`FLIGHT_RECORD_FORMAT`] stays: a reader from before them refuses a record holding a
//! replay (its kind is unknown there) and reads any other, ignoring `"captured_in"`. The
//! graphs' fields are read and written in `json/graphs.rs`.
//!
//! `"shipped_created"` and `"graphs_recorded"` count the instances and graphs the
//! communicator numbered, forgotten ones included (null or absent in older records).

mod graphs;

use serde_json::{Map, Value};

use super::op_kind::OpKind;
use super::record::{FlightEntry, FlightRecord, OpState, RecordedReduction};
use super::shipped::{ShippedCall, ShippedEnd, ShippedInstance, ShippedKernel};
use crate::dtype::DataType;
use crate::error::{Error, Result};

/// The value of `"format"`: changes when a field changes meaning.
pub const FLIGHT_RECORD_FORMAT: &str = "nccl-rs flight record 1";

impl FlightRecord {
    /// The record as a JSON document (see the shape in [`FlightRecord::from_json`]).
    pub fn to_json(&self) -> String {
        let mut text = serde_json::to_string_pretty(&self.to_value()).unwrap_or_default();
        text.push('\n');
        text
    }

    fn to_value(&self) -> Value {
        let mut map = Map::new();
        map.insert("format".into(), FLIGHT_RECORD_FORMAT.into());
        map.insert("rank".into(), self.rank.into());
        map.insert("size".into(), self.size.into());
        map.insert("device".into(), self.device.into());
        map.insert(
            "name".into(),
            self.name.clone().map_or(Value::Null, Value::from),
        );
        map.insert("pid".into(), self.pid.into());
        map.insert("serial".into(), self.serial.into());
        map.insert("capacity".into(), self.capacity.into());
        map.insert("recorded".into(), self.recorded.into());
        map.insert("collectives".into(), self.collectives.into());
        map.insert("completed_through".into(), self.completed_through.into());
        map.insert("taken_at_us".into(), self.taken_at_us.into());
        map.insert("reason".into(), self.reason.clone().into());
        let entries = self.entries.iter().map(entry_value).collect();
        map.insert("entries".into(), Value::Array(entries));
        let shipped = self.shipped.iter().map(instance_value).collect();
        map.insert("shipped".into(), Value::Array(shipped));
        let graphs = self.graphs.iter().map(graphs::graph_value).collect();
        map.insert("graphs".into(), Value::Array(graphs));
        let number = |n: Option<u32>| n.map_or(Value::Null, Value::from);
        map.insert("shipped_created".into(), number(self.shipped_created));
        map.insert("graphs_recorded".into(), number(self.graphs_recorded));
        Value::Object(map)
    }

    /// Reads a record written by [`FlightRecord::to_json`]. A document that is not JSON, or
    /// lacks a field, or has one of the wrong type, is an [`Error::FlightRecordFormat`]
    /// naming it.
    pub fn from_json(text: &str) -> Result<FlightRecord> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| Error::FlightRecordFormat(format!("not JSON: {e}")))?;
        let at = Fields {
            value: &value,
            what: "the record",
        };
        let format = at.string("format")?;
        if format != FLIGHT_RECORD_FORMAT {
            return Err(Error::FlightRecordFormat(format!(
                "format {format:?}, expected {FLIGHT_RECORD_FORMAT:?}"
            )));
        }
        let entries = at
            .get("entries")?
            .as_array()
            .ok_or_else(|| at.wrong("entries", "an array"))?
            .iter()
            .enumerate()
            .map(|(i, value)| entry_from(value, i))
            .collect::<Result<Vec<_>>>()?;
        let shipped = match at.optional("shipped") {
            None => Vec::new(),
            Some(list) => list
                .as_array()
                .ok_or_else(|| at.wrong("shipped", "an array"))?
                .iter()
                .enumerate()
                .map(|(i, value)| instance_from(value, i))
                .collect::<Result<Vec<_>>>()?,
        };
        let graphs = match at.optional("graphs") {
            None => Vec::new(),
            Some(list) => list
                .as_array()
                .ok_or_else(|| at.wrong("graphs", "an array"))?
                .iter()
                .enumerate()
                .map(|(i, value)| graphs::graph_from(value, i))
                .collect::<Result<Vec<_>>>()?,
        };
        let record = FlightRecord {
            rank: at.usize("rank")?,
            size: at.usize("size")?,
            device: at.usize("device")?,
            name: at.optional_string("name")?,
            pid: u32::try_from(at.u64("pid")?).map_err(|_| at.wrong("pid", "a process id"))?,
            serial: at.u64("serial")?,
            capacity: at.usize("capacity")?,
            recorded: at.u64("recorded")?,
            collectives: at.u64("collectives")?,
            completed_through: at.u64("completed_through")?,
            shipped,
            graphs,
            shipped_created: at.optional_u32("shipped_created")?,
            graphs_recorded: at.optional_u32("graphs_recorded")?,
            taken_at_us: at.u64("taken_at_us")?,
            reason: at.string("reason")?.to_owned(),
            entries,
        };
        consistent(&record)?;
        Ok(record)
    }
}

/// The most operations a record may claim: far past any job, and far enough from `u64::MAX`
/// that the analyser's sequence arithmetic cannot overflow.
const MOST_OPERATIONS: u64 = 1 << 62;

/// A record read from a file holds together: a rank of its size, counters no larger than
/// [`MOST_OPERATIONS`] and ordered (`completed_through` ≤ `collectives` ≤ `recorded`), no more
/// entries than its capacity or its count, entries' numbers within the counters, and its
/// replays and graphs likewise (`graphs::consistent`).
fn consistent(r: &FlightRecord) -> Result<()> {
    let bad = |why: String| Err(Error::FlightRecordFormat(why));
    if r.size == 0 || r.rank >= r.size {
        return bad(format!("rank {} of {} ranks", r.rank, r.size));
    }
    if r.recorded > MOST_OPERATIONS
        || r.collectives > r.recorded
        || r.completed_through > r.recorded
    {
        return bad(format!(
            "counters out of order or too large: {} recorded, {} collectives, completed \
             through {}",
            r.recorded, r.collectives, r.completed_through
        ));
    }
    if r.entries.len() > r.capacity || r.entries.len() as u64 > r.recorded {
        return bad(format!(
            "{} entries in a ring of {} with {} recorded",
            r.entries.len(),
            r.capacity,
            r.recorded
        ));
    }
    for e in &r.entries {
        if e.seq == 0
            || e.seq > r.recorded
            || e.collective_seq
                .is_some_and(|c| c == 0 || c > r.collectives)
        {
            return bad(format!(
                "an entry numbered past the record's counters: {e:?}"
            ));
        }
        if e.kind.is_shipped() != e.shipped.is_some()
            || (e.shipped.is_some() && e.collective_seq.is_some())
        {
            return bad(format!(
                "a shipped kind without its instance, or the reverse: {e:?}"
            ));
        }
        if let Some(call) = e.shipped {
            let calls = r
                .shipped_instance(call.instance)
                .map_or(MOST_OPERATIONS, |i| i.calls);
            if call.seq.is_some_and(|s| s == 0 || s > calls) || call.kernel.kind() != e.kind {
                return bad(format!(
                    "a shipped call numbered past its instance's counters, or of another \
                     kind's kernel: {e:?}"
                ));
            }
        }
    }
    let mut last = 0;
    for i in &r.shipped {
        if i.instance <= last
            || i.calls > MOST_OPERATIONS
            || i.ended.is_some_and(|end| end.after() > i.calls)
        {
            return bad(format!(
                "shipped instances out of order, or counters out of order or too large: {i:?}"
            ));
        }
        last = i.instance;
    }
    graphs::consistent(r).map_err(Error::FlightRecordFormat)
}

fn entry_value(entry: &FlightEntry) -> Value {
    let opt = |v: Option<u64>| v.map_or(Value::Null, Value::from);
    let mut map = Map::new();
    map.insert("seq".into(), entry.seq.into());
    map.insert("collective_seq".into(), opt(entry.collective_seq));
    map.insert("kind".into(), entry.kind.name().into());
    map.insert(
        "dtype".into(),
        entry.dtype.map_or(Value::Null, |d| d.name().into()),
    );
    map.insert("count".into(), entry.count.into());
    map.insert("root".into(), opt(entry.root.map(|r| r as u64)));
    map.insert("peer".into(), opt(entry.peer.map(|p| p as u64)));
    map.insert(
        "reduction".into(),
        entry.reduction.map_or(Value::Null, |r| r.name().into()),
    );
    map.insert("stream".into(), entry.stream.into());
    map.insert("group".into(), opt(entry.group.map(u64::from)));
    map.insert("enqueued_at_us".into(), entry.enqueued_at_us.into());
    map.insert("state".into(), entry.state.name().into());
    let shipped = entry.shipped.map_or(Value::Null, |call| {
        let mut map = Map::new();
        map.insert("instance".into(), call.instance.into());
        map.insert("seq".into(), opt(call.seq));
        map.insert("kernel".into(), call.kernel.name().into());
        Value::Object(map)
    });
    map.insert("shipped".into(), shipped);
    map.insert("replay".into(), graphs::replay_value(entry.replay));
    map.insert("captured_in".into(), opt(entry.captured_in.map(u64::from)));
    Value::Object(map)
}

fn instance_value(instance: &ShippedInstance) -> Value {
    let mut map = Map::new();
    map.insert("instance".into(), instance.instance.into());
    map.insert("calls".into(), instance.calls.into());
    map.insert(
        "ended".into(),
        instance.ended.map_or(Value::Null, |e| e.name().into()),
    );
    map.insert(
        "ended_after".into(),
        instance.ended.map_or(Value::Null, |e| e.after().into()),
    );
    map.insert("dropped".into(), instance.dropped.into());
    Value::Object(map)
}

fn instance_from(value: &Value, index: usize) -> Result<ShippedInstance> {
    let what = format!("shipped instance {index}");
    let at = Fields { value, what: &what };
    let ended = match at.optional_string("ended")? {
        None => None,
        Some(name) => {
            let after = at.u64("ended_after")?;
            Some(
                ShippedEnd::from_name(&name, after)
                    .ok_or_else(|| at.wrong("ended", "\"gave up\", \"stopped\" or null"))?,
            )
        }
    };
    Ok(ShippedInstance {
        instance: at.u32("instance")?,
        calls: at.u64("calls")?,
        ended,
        dropped: at.bool("dropped")?,
    })
}

fn shipped_from(at: &Fields<'_>) -> Result<Option<ShippedCall>> {
    let Some(value) = at.optional("shipped") else {
        return Ok(None);
    };
    let what = format!("{}'s shipped call", at.what);
    let call = Fields { value, what: &what };
    let kernel = ShippedKernel::from_name(call.string("kernel")?)
        .ok_or_else(|| call.wrong("kernel", "a shipped kernel's name"))?;
    Ok(Some(ShippedCall {
        instance: call.u32("instance")?,
        seq: call.optional_u64("seq")?,
        kernel,
    }))
}

fn entry_from(value: &Value, index: usize) -> Result<FlightEntry> {
    let what = format!("entry {index}");
    let at = Fields { value, what: &what };
    let kind_name = at.string("kind")?;
    let kind = OpKind::from_name(kind_name).ok_or_else(|| at.wrong("kind", "an operation kind"))?;
    let dtype = match at.optional_string("dtype")? {
        None => None,
        Some(name) => Some(
            DataType::ALL
                .into_iter()
                .find(|d| d.name() == name)
                .ok_or_else(|| at.wrong("dtype", "an NCCL data type name"))?,
        ),
    };
    let reduction = match at.optional_string("reduction")? {
        None => None,
        Some(name) => Some(
            RecordedReduction::from_name(&name)
                .ok_or_else(|| at.wrong("reduction", "a reduction name"))?,
        ),
    };
    let state =
        OpState::from_name(at.string("state")?).ok_or_else(|| at.wrong("state", "a state"))?;
    let number = |key: &str| -> Result<Option<u32>> {
        match at.optional_u64(key)? {
            None => Ok(None),
            Some(n) => Ok(Some(
                u32::try_from(n).map_err(|_| at.wrong(key, "a 32-bit number"))?,
            )),
        }
    };
    let group = number("group")?;
    Ok(FlightEntry {
        seq: at.u64("seq")?,
        collective_seq: at.optional_u64("collective_seq")?,
        shipped: shipped_from(&at)?,
        replay: graphs::replay_from(&at)?,
        kind,
        dtype,
        count: at.u64("count")?,
        root: at.optional_usize("root")?,
        peer: at.optional_usize("peer")?,
        reduction,
        stream: at.u64("stream")?,
        group,
        captured_in: number("captured_in")?,
        enqueued_at_us: at.u64("enqueued_at_us")?,
        state,
    })
}

/// Typed access to an object's fields, with errors that name the field and its owner.
struct Fields<'v> {
    value: &'v Value,
    what: &'v str,
}

impl<'v> Fields<'v> {
    fn get(&self, key: &str) -> Result<&'v Value> {
        self.value
            .get(key)
            .ok_or_else(|| Error::FlightRecordFormat(format!("{} has no {key:?}", self.what)))
    }

    fn wrong(&self, key: &str, expected: &str) -> Error {
        Error::FlightRecordFormat(format!("{}: {key:?} is not {expected}", self.what))
    }

    fn u64(&self, key: &str) -> Result<u64> {
        self.get(key)?
            .as_u64()
            .ok_or_else(|| self.wrong(key, "a non-negative integer"))
    }

    fn u32(&self, key: &str) -> Result<u32> {
        u32::try_from(self.u64(key)?).map_err(|_| self.wrong(key, "a 32-bit number"))
    }

    fn usize(&self, key: &str) -> Result<usize> {
        usize::try_from(self.u64(key)?).map_err(|_| self.wrong(key, "a size"))
    }

    fn bool(&self, key: &str) -> Result<bool> {
        self.get(key)?
            .as_bool()
            .ok_or_else(|| self.wrong(key, "a boolean"))
    }

    fn string(&self, key: &str) -> Result<&'v str> {
        self.get(key)?
            .as_str()
            .ok_or_else(|| self.wrong(key, "a string"))
    }

    fn optional(&self, key: &str) -> Option<&'v Value> {
        self.value.get(key).filter(|v| !v.is_null())
    }

    fn optional_u32(&self, key: &str) -> Result<Option<u32>> {
        self.optional_u64(key)?
            .map(|n| u32::try_from(n).map_err(|_| self.wrong(key, "a 32-bit count")))
            .transpose()
    }

    fn optional_u64(&self, key: &str) -> Result<Option<u64>> {
        match self.optional(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| self.wrong(key, "a non-negative integer or null")),
        }
    }

    fn optional_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.optional_u64(key)? {
            None => Ok(None),
            Some(v) => usize::try_from(v)
                .map(Some)
                .map_err(|_| self.wrong(key, "a rank")),
        }
    }

    fn optional_string(&self, key: &str) -> Result<Option<String>> {
        match self.optional(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(|s| Some(s.to_owned()))
                .ok_or_else(|| self.wrong(key, "a string or null")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::synthetic::{record, with_shipped};
    use super::*;

    #[test]
    fn shipped_calls_survive_json_and_old_records_still_read() {
        let rec = with_shipped(
            record(0, 2, &[(1, 8), (2, 16)], 2),
            3,
            &[(1, 100), (2, 200)],
            1,
            Some(ShippedEnd::GaveUp { after: 2 }),
        );
        let text = rec.to_json();
        assert!(text.contains("\"kernel\": \"one-shot-flags\""), "{text}");
        assert!(text.contains("\"ended\": \"gave up\""), "{text}");
        assert_eq!(FlightRecord::from_json(&text).unwrap(), rec);

        // Written before shipped kernels were recorded: no "shipped" anywhere.
        let old = record(1, 2, &[(1, 8), (2, 16)], 1);
        let mut value: Value = serde_json::from_str(&old.to_json()).unwrap();
        value.as_object_mut().unwrap().remove("shipped");
        value.as_object_mut().unwrap().remove("shipped_created");
        for entry in value["entries"].as_array_mut().unwrap() {
            entry.as_object_mut().unwrap().remove("shipped");
        }
        let text_old = value.to_string();
        assert!(!text_old.contains("shipped"));
        assert_eq!(FlightRecord::from_json(&text_old).unwrap(), old);

        for (from, to, needle) in [
            ("\"one-shot-flags\"", "\"six-shot\"", "kernel"),
            ("\"gave up\"", "\"melted\"", "ended"),
            ("\"LsaAllReduce\"", "\"AllReduce\"", "shipped kind"),
            (
                "\"one-shot-flags\",\n        \"seq\": 2",
                "\"one-shot-flags\",\n        \"seq\": 9",
                "past its instance",
            ),
        ] {
            assert!(text.contains(from), "{from} in {text}");
            let broken = text.replace(from, to);
            let err = FlightRecord::from_json(&broken).unwrap_err().to_string();
            assert!(err.contains(needle), "{needle}: {err}");
        }
    }

    #[test]
    fn records_survive_json_and_bad_documents_are_typed_errors() {
        let mut rec = record(1, 2, &[(1, 1024), (2, 2048)], 1);
        rec.name = Some("trainer \"tp\"\n".into());
        rec.entries[0].group = Some(3);
        rec.entries[1].root = Some(0);
        rec.entries[1].kind = OpKind::Broadcast;
        rec.entries[1].reduction = None;
        let text = rec.to_json();
        assert_eq!(FlightRecord::from_json(&text).unwrap(), rec);

        for (doc, needle) in [
            ("{", "not JSON"),
            ("[]", "has no \"format\""),
            (r#"{"format": "other"}"#, "format \"other\""),
        ] {
            match FlightRecord::from_json(doc) {
                Err(Error::FlightRecordFormat(why)) => assert!(why.contains(needle), "{why}"),
                other => panic!("{doc}: {other:?}"),
            }
        }
        let broken = text.replace("\"AllReduce\"", "\"AllReduceX\"");
        let err = FlightRecord::from_json(&broken).unwrap_err().to_string();
        assert!(err.contains("entry 0") && err.contains("kind"), "{err}");
        let broken = text.replace("\"count\": 1024", "\"count\": -1");
        let err = FlightRecord::from_json(&broken).unwrap_err().to_string();
        assert!(err.contains("count"), "{err}");
    }
}
