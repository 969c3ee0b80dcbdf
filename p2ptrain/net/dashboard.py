"""The read-only views of a node's status: Prometheus text for `/metrics` and the dashboard
page for `/` (a static page that polls `/v1/status`; it takes no input). Pure: status
document in, text out.
"""

from __future__ import annotations

from typing import Any

_GAUGES = (  # status key, metric name, help
    ("step", "p2ptrain_step", "local optimiser steps taken"),
    ("loss", "p2ptrain_train_loss", "training loss of the last step (nats/token)"),
    ("eval_loss", "p2ptrain_eval_loss", "last held-out loss (nats/token)"),
    ("samples", "p2ptrain_samples", "samples this node has processed"),
    ("swarm_samples", "p2ptrain_swarm_samples", "the swarm's sample count as this node knows it"),
    ("term", "p2ptrain_term", "election term this node follows"),
    ("bytes_in", "p2ptrain_bytes_in", "protocol bytes received"),
    ("bytes_out", "p2ptrain_bytes_out", "protocol bytes sent"),
    ("consensus_distance", "p2ptrain_consensus_distance",
     "RMS distance to the last averaging partner"),
    ("skipped_steps", "p2ptrain_skipped_steps", "steps discarded for non-finite values"),
)


def metrics(status: dict[str, Any]) -> str:
    """Prometheus text exposition of a status document."""
    lines = []
    for key, name, text in _GAUGES:
        value = status.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            lines += [f"# HELP {name} {text}", f"# TYPE {name} gauge", f"{name} {value}"]
    states: dict[str, int] = {}
    for member in status.get("members", []):
        states[member["state"]] = states.get(member["state"], 0) + 1
    lines += ["# HELP p2ptrain_members members known, by state", "# TYPE p2ptrain_members gauge"]
    lines += [f'p2ptrain_members{{state="{s}"}} {n}' for s, n in sorted(states.items())]
    lines += ["# HELP p2ptrain_is_leader 1 while this node is the checkpoint leader",
              "# TYPE p2ptrain_is_leader gauge",
              f"p2ptrain_is_leader {1 if status.get('is_leader') else 0}"]
    return "\n".join(lines) + "\n"


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>p2ptrain node</title>
<style>
body{font:14px system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse}td,th{padding:.25em .8em;border-bottom:1px solid #ddd;
text-align:right}th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}
.leader{font-weight:bold}
</style></head><body>
<h1>p2ptrain</h1><p id="summary">loading...</p>
<table><thead><tr><th>node</th><th>address</th><th>state</th><th>class</th><th>step</th>
<th>loss</th><th>samples</th><th>in</th><th>out</th><th>RTT ms</th></tr></thead>
<tbody id="rows"></tbody></table>
<script>
function cell(v){const td=document.createElement('td');
 td.textContent=(v===null||v===undefined)?'-':(typeof v==='number'&&!Number.isInteger(v))?
 v.toFixed(3):String(v);return td}
async function refresh(){
 try{const s=await (await fetch('/v1/status')).json();
  document.getElementById('summary').textContent=
   `node ${s.node_id.slice(0,12)} | ${s.phase} | step ${s.step} | loss ${s.loss??'-'} | `+
   `held-out ${s.eval_loss??'-'} | swarm samples ${s.swarm_samples} | leader `+
   `${(s.leader||'none').slice(0,12)} (term ${s.term})`;
  const body=document.getElementById('rows');body.textContent='';
  for(const m of s.members){const tr=document.createElement('tr');
   if(m.node_id===s.leader)tr.className='leader';
   for(const v of [m.node_id.slice(0,12),m.addr,m.state,m.device_class,m.step,m.loss,
    m.samples,m.bytes_in,m.bytes_out,m.rtt_ms])tr.appendChild(cell(v));
   body.appendChild(tr)}
 }catch(e){document.getElementById('summary').textContent='node unreachable'}}
refresh();setInterval(refresh,2000);
</script></body></html>
"""
