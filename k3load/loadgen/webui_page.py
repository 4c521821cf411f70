"""The live page served at `/k3load/` (no build step, no external asset: it polls `/k3load/state`), and
the small script that shows it inside Locust's k3load tab, under the tab's table (`TAB_JS`)."""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>k3load live</title>
<style>
body{font-family:system-ui,sans-serif;margin:1em 2em;color:#222}
h1{font-size:1.3em;margin:.2em 0} h2{font-size:1.05em;margin:1em 0 .3em}
table{border-collapse:collapse;font-size:.92em} td{padding:2px 10px;border-bottom:1px solid #eee}
td:first-child{color:#555} .charts{display:flex;flex-wrap:wrap;gap:14px}
.chart{border:1px solid #ddd;padding:4px} .chart b{font-size:.85em}
#verdict{font-size:1.1em;padding:.5em;border-radius:4px;background:#f4f4f4}
.go{background:#d8f5d8!important}.limited{background:#fff3c4!important}
.scale_up,.rebuild{background:#fbd5d5!important}
svg text{font-size:10px;fill:#666}
body.embed{margin:0 .5em} body.embed .full{display:none}
</style></head><body>
<h1>k3load live &mdash; <span id="run">no run yet</span></h1>
<div class="full"><a href="../" target="_top">&larr; Locust</a> &middot; <a href="state">state (JSON)</a>
 &middot; <a href="./" target="_blank">this page alone</a></div>
<h2>Verdict</h2><div id="verdict">at the test's stop</div><div id="links"></div>
<div class="full"><h2>Now</h2><table id="signals"></table></div>
<div id="search-box" style="display:none"><h2>Capacity search</h2><table id="search"></table></div>
<h2>Goodput by stage (requests that met every SLO so far)</h2><table id="goodput"></table>
<h2>KV usage, waiting and GPU memory, with the user count (dashed)</h2>
<div class="charts"><div class="chart"><b>KV cache usage (%)</b><svg id="c-kv" width="360" height="140"></svg></div>
<div class="chart"><b>waiting requests</b><svg id="c-waiting" width="360" height="140"></svg></div>
<div class="chart"><b>GPU memory used (MiB)</b><svg id="c-gpu" width="360" height="140"></svg></div></div>
<h2 id="pillars-title">Pillars so far (the final analysis's functions over the run so far)</h2>
<table id="pillars"></table>
<script>
if(new URLSearchParams(location.search).has('embed'))document.body.classList.add('embed');
function esc(s){return String(s).replace(/[&<>"]/g,c=>({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'}[c]))}
function num(v,d){return v===null||v===undefined?'\\u2013':Number(v).toFixed(d)}
function pct(v){return v===null||v===undefined?'\\u2013':(v*100).toFixed(1)+'%'}
function gp(v,ci,n){return n?`${pct(v)} (95% CI ${pct(ci[0])}\\u2013${pct(ci[1])}) of ${n} requests`:'\\u2013'}
function unitOf(q){return q.search_on==='sessions_per_s'?'sessions/s':'users'}
function searchRows(q){const d=q.last_decision;return [['search',q.stage+(q.ended?` (ended: ${q.ended})`:'')],
 ['step',q.step?`${q.step}${q.repeat?' (repeat of a step near the bound)':''}`:'\\u2013'],
 ['users',q.users===null?'\\u2013':q.users+(q.sessions_per_s!=null?
   ` session slots, ${q.sessions_per_s} sessions/s arriving`:'')],
 ['step time',`${num(q.elapsed_s,0)} s (at least ${num(q.step_s,0)}, at most ${num(q.max_step_s,0)})`],
 ['goodput so far',gp(q.goodput,q.goodput_ci95,q.requests)+` against ${pct(q.min_goodput)}`],
 ['queue behind a full batch',q.queue_share===null?'\\u2013':
   pct(q.queue_share)+' of scrapes (past capacity above 50%)'],
 ['KV usage (step max)',pct(q.kv_usage_max)],
 ['bracket: last held / first failed',`${q.last_good??'\\u2013'} / ${q.first_bad??'\\u2013'} ${unitOf(q)}`],
 ['last decision',d?`${d.sessions_per_s??d.users} ${unitOf(q)}: ${d.decision}`:'\\u2013'],
 ['search time',`${num(q.total_s,0)} of at most ${num(q.max_total_s,0)} s`]]}
function line(pts,w,h,max,dash,color){if(!pts.length)return '';
 const t0=pts[0][0],t1=Math.max(pts[pts.length-1][0],t0+1);
 const p=pts.map(([t,v])=>((t-t0)/(t1-t0)*(w-40)+30).toFixed(1)+','+(h-15-(v/max)*(h-25)).toFixed(1)).join(' ');
 return `<polyline fill="none" stroke="${color}" stroke-width="1.5" `+
  `${dash?'stroke-dasharray="4 3"':''} points="${p}"/>`}
function chart(id,hist,key,scale){const svg=document.getElementById(id),w=360,h=140;
 const pts=hist.filter(r=>r[key]!==null&&r[key]!==undefined).map(r=>[r.ts,r[key]*scale]);
 const users=hist.map(r=>[r.ts,r.users]);const max=Math.max(1e-9,...pts.map(p=>p[1]));
 const umax=Math.max(1,...users.map(p=>p[1]));
 svg.innerHTML=`<line x1="30" y1="${h-15}" x2="${w-10}" y2="${h-15}" stroke="#aaa"/>`+
  `<text x="2" y="12">${num(max,0)}</text><text x="2" y="${h-15}">0</text>`+
  `<text x="${w-70}" y="12">users ${umax}</text>`+line(pts,w,h,max,false,'#1565c0')+line(users,w,h,umax,true,'#888');
 svg.dataset.points=pts.length}
async function tick(){let s;try{s=await (await fetch('state',{cache:'no-store'})).json()}catch(e){return}
 document.getElementById('run').textContent=s.run_id?`${s.run_id} (${s.run_dir})`:'no run yet';
 const g=s.signals||{},st=s.stage;const rows=[['state',s.state],
  ['stage',st?`${st.name} (${st.kind}, ${st.users} users) `+
   (st.left_s===null?'set by hand':`${num(st.left_s,0)} s left`):'\\u2013'],
  ['stage goodput',st?gp(st.goodput,st.goodput_ci95,st.goodput_requests):'\\u2013'],
  ['users',g.users],['requests/s',num(g.requests_per_s,2)],
  ['TTFT p50 / p95 ms',num(g.ttft_p50_ms,0)+' / '+num(g.ttft_p95_ms,0)],
  ['first answer token (TTFA) p50 / p95 ms',num(g.ttfa_p50_ms,0)+' / '+num(g.ttfa_p95_ms,0)],
  ['ITL p50 / p95 ms',num(g.itl_p50_ms,0)+' / '+num(g.itl_p95_ms,0)],
  ['e2e p50 / p95 ms',num(g.e2e_p50_ms,0)+' / '+num(g.e2e_p95_ms,0)],
  ['KV cache usage',g.kv_usage==null?'\\u2013':num(g.kv_usage*100,1)+'%'],
  ['running / waiting',num(g.running,0)+' / '+num(g.waiting,0)],['preemptions (this run)',num(g.preemptions,0)],
  ['prefix cache hit ratio',g.prefix_cache_hit_ratio==null?'\\u2013':num(g.prefix_cache_hit_ratio*100,1)+'%'],
  ...(g.gpus||[]).map(x=>[`GPU memory ${x.node} #${x.gpu}`+(x.simulated?' (simulated)':''),
    num(x.memory_used_mib,0)+' / '+num(x.memory_total_mib,0)+' MiB']),
  ...Object.entries(g.load_generator_cpu_pct||{}).map(([k,v])=>['load generator CPU '+k,num(v,0)+'%']),
  ['attempts (valid)',`${g.attempts||0} (${g.valid||0})`],
  ['failures by layer',Object.entries(g.failed_by_layer||{}).map(([k,v])=>k+' '+v).join(', ')||'none']];
 document.getElementById('signals').innerHTML=rows.map(([k,v])=>
  `<tr data-key="${esc(k)}"><td>${esc(k)}</td><td>${esc(v)}</td></tr>`).join('');
 const q=s.search,box=document.getElementById('search-box');box.style.display=q?'':'none';
 document.getElementById('search').innerHTML=q?searchRows(q).map(([k,v])=>
  `<tr data-key="${esc(k)}"><td>${esc(k)}</td><td>${esc(v)}</td></tr>`).join(''):'';
 document.getElementById('goodput').innerHTML=(s.goodput||[]).map(x=>
  `<tr data-stage="${esc(x.stage)}"><td>${esc(x.stage)}</td>`+
  `<td>${esc(gp(x.goodput,x.goodput_ci95,x.requests))}</td></tr>`).join('');
 document.getElementById('pillars').innerHTML=Object.entries(s.pillars||{}).map(([k,p])=>
  `<tr><td>${esc(k)}</td><td><b>${esc(p.status)}</b> ${esc(p.reason)}</td></tr>`).join('');
 const v=document.getElementById('verdict'),l=document.getElementById('links');
 document.getElementById('pillars-title').textContent=s.verdict?"Pillars (the verdict's)":
  "Pillars so far (the final analysis's functions over the run so far)";
 if(s.verdict){v.className=s.verdict.verdict;v.innerHTML=`<b>${esc(s.verdict.verdict)}</b>: `+
  s.verdict.because.map(esc).join('; ');l.innerHTML=Object.entries(s.verdict.links).map(([k,u])=>
  `<a id="link-${esc(k.replace('.','-'))}" target="_blank" href="..${esc(u)}">${esc(k)}</a>`).join(' &middot; ')}
 else if(s.error){v.className='rebuild';v.textContent='harness error (no verdict): '+s.error;l.innerHTML=''}
 else{v.className='';v.textContent=s.state==='running'||s.state==='spawning'?'running: judged at the test\\'s stop':
  (s.run_id?'judging\\u2026':'no run yet');l.innerHTML=''}
 const h=s.history||[];chart('c-kv',h,'kv_usage',100);chart('c-waiting',h,'waiting',1);
 chart('c-gpu',h,'gpu_memory_used_mib',1)}
tick();setInterval(tick,2000);
</script></body></html>
"""

# Locust 2.47's extended tab renders only a text table; this script (added to Locust's index page by an
# `after_request` hook) puts the live page, with its charts and links, in an iframe under that table
# while the k3load tab is open, and removes it when another tab is chosen.
TAB_JS = """(function(){
function onTab(){return new URLSearchParams(location.search).get('tab')==='k3load'}
setInterval(function(){
 var frame=document.getElementById('k3load-live');
 if(!onTab()){if(frame)frame.remove();return}
 if(frame&&frame.isConnected)return;  // once placed it stays (re-placing it would reload the page)
 var table=document.querySelector('main table')||document.querySelector('table');
 if(!table)return;
 var box=table.closest('.MuiTableContainer-root')||table;
 frame=document.createElement('iframe');frame.id='k3load-live';frame.src='./k3load/?embed=1';
 frame.title='k3load live';frame.style.cssText='width:100%;height:760px;border:0;margin-top:8px';
 box.insertAdjacentElement('afterend',frame);
},500);
})();
"""
