//! The CUDA graphs' fields of a flight record in JSON (see the shape in the parent module):
//! a replay's `"replay"`, the record's `"graphs"`, and what makes them hold together.

use serde_json::{Map, Value};

use super::super::graph::{CapturedGraph, GraphReplay};
use super::super::op_kind::OpKind;
use super::super::record::FlightRecord;
use super::{Fields, MOST_OPERATIONS};
use crate::error::Result;

pub(super) fn replay_value(replay: Option<GraphReplay>) -> Value {
    replay.map_or(Value::Null, |replay| {
        let mut map = Map::new();
        map.insert("graph".into(), replay.graph.into());
        map.insert("seq".into(), replay.seq.map_or(Value::Null, Value::from));
        Value::Object(map)
    })
}

pub(super) fn graph_value(graph: &CapturedGraph) -> Value {
    let mut map = Map::new();
    map.insert("graph".into(), graph.graph.into());
    map.insert("captured_from".into(), graph.captured_from.into());
    map.insert("captured_through".into(), graph.captured_through.into());
    map.insert("stream".into(), graph.stream.into());
    map.insert("operations".into(), graph.operations.into());
    map.insert("collectives".into(), graph.collectives.into());
    map.insert("replays".into(), graph.replays.into());
    map.insert("dropped".into(), graph.dropped.into());
    Value::Object(map)
}

pub(super) fn graph_from(value: &Value, index: usize) -> Result<CapturedGraph> {
    let what = format!("graph {index}");
    let at = Fields { value, what: &what };
    Ok(CapturedGraph {
        graph: at.u32("graph")?,
        captured_from: at.u64("captured_from")?,
        captured_through: at.u64("captured_through")?,
        stream: at.u64("stream")?,
        operations: at.u64("operations")?,
        collectives: at.u64("collectives")?,
        replays: at.u64("replays")?,
        dropped: at.bool("dropped")?,
    })
}

pub(super) fn replay_from(at: &Fields<'_>) -> Result<Option<GraphReplay>> {
    let Some(value) = at.optional("replay") else {
        return Ok(None);
    };
    let what = format!("{}'s replay", at.what);
    let replay = Fields { value, what: &what };
    Ok(Some(GraphReplay {
        graph: replay.u32("graph")?,
        seq: replay.optional_u64("seq")?,
    }))
}

/// A record's replays and graphs hold together: a replay (and only a replay) has a graph,
/// no collective number and no element type, and a number within its graph's counters;
/// the graphs are in ascending order, their counters no larger than [`MOST_OPERATIONS`],
/// their captured range within the record's operations and their counts within the range.
pub(super) fn consistent(r: &FlightRecord) -> std::result::Result<(), String> {
    for e in &r.entries {
        if (e.kind == OpKind::GraphReplay) != e.replay.is_some()
            || (e.replay.is_some() && (e.collective_seq.is_some() || e.dtype.is_some()))
        {
            return Err(format!(
                "a replay without its graph, or the reverse, or with a collective number or \
                 an element type: {e:?}"
            ));
        }
        if let Some(replay) = e.replay {
            let replays = r
                .captured_graph(replay.graph)
                .map_or(MOST_OPERATIONS, |g| g.replays);
            if replay.seq.is_some_and(|s| s == 0 || s > replays) {
                return Err(format!(
                    "a replay numbered past its graph's counters: {e:?}"
                ));
            }
        }
    }
    let mut last = 0;
    for g in &r.graphs {
        // In this order, so that `captured_through + 1 - captured_from` cannot overflow.
        if g.graph <= last
            || g.replays > MOST_OPERATIONS
            || g.captured_through > r.recorded
            || g.captured_from > g.captured_through.saturating_add(1)
            || g.operations > g.captured_through + 1 - g.captured_from
            || g.collectives > g.operations
        {
            return Err(format!(
                "graphs out of order, or counters out of order or too large: {g:?}"
            ));
        }
        last = g.graph;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::super::synthetic::{record, with_graph};
    use super::*;

    #[test]
    fn graphs_survive_json_and_old_records_still_read() {
        let mut rec = with_graph(record(0, 2, &[(1, 8), (2, 16)], 2), 2, 14, &[1, 2, 3], 2);
        rec.entries[1].captured_in = Some(2);
        (rec.graphs_recorded, rec.shipped_created) = (Some(2), Some(0));
        let text = rec.to_json();
        for needle in [
            "\"kind\": \"GraphReplay\"",
            "\"captured_in\": 2",
            "\"operations\": 14",
            "\"replays\": 3",
            "\"graphs_recorded\": 2",
        ] {
            assert!(text.contains(needle), "{needle} in {text}");
        }
        assert_eq!(FlightRecord::from_json(&text).unwrap(), rec);

        // Written before graphs were recorded: no "graphs", "replay" or "captured_in".
        let old = record(1, 2, &[(1, 8), (2, 16)], 1);
        let mut value: Value = serde_json::from_str(&old.to_json()).unwrap();
        value.as_object_mut().unwrap().remove("graphs");
        value.as_object_mut().unwrap().remove("graphs_recorded");
        for entry in value["entries"].as_array_mut().unwrap() {
            let entry = entry.as_object_mut().unwrap();
            entry.remove("replay");
            entry.remove("captured_in");
        }
        let text_old = value.to_string();
        assert!(!text_old.contains("graph") && !text_old.contains("captured"));
        let read = FlightRecord::from_json(&text_old).unwrap();
        assert!(read.graphs.is_empty());
        assert!(read
            .entries
            .iter()
            .all(|e| e.replay.is_none() && e.captured_in.is_none()));
        assert_eq!(read, old);

        for (from, to, needle) in [
            (
                "\"GraphReplay\"",
                "\"AllReduce\"",
                "a replay without its graph",
            ),
            (
                "\"replays\": 3",
                "\"replays\": 2",
                "past its graph's counters",
            ),
            (
                "\"operations\": 14",
                "\"operations\": 15",
                "graphs out of order",
            ),
            ("\"captured_in\": 2", "\"captured_in\": -2", "captured_in"),
            ("\"dropped\": false", "\"dropped\": 0", "dropped"),
        ] {
            assert!(text.contains(from), "{from} in {text}");
            let broken = text.replace(from, to);
            let err = FlightRecord::from_json(&broken).unwrap_err().to_string();
            assert!(err.contains(needle), "{needle}: {err}");
        }
    }
}
