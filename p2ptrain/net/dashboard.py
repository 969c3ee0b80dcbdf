"""The dashboard page for `/`: a static page that polls `/v1/status` (it takes no input).
Prometheus's `/metrics` is metrics.py."""

from __future__ import annotations

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
