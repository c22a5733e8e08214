// kvfleet dashboard: follows /stats/stream and draws the cluster's KV cache with plotly.js.
// The stream is read with fetch() and a small SSE parser, not EventSource, because EventSource cannot send
// the Authorization header; the parser sends Last-Event-ID itself and reconnects with backoff. Records are
// batched: the charts are redrawn at most every REDRAW_MS from the last MAX_RECORDS records (Plotly.react),
// and the server is asked for the records of each REDRAW_MS in one write (interval_ms): a GPU's 100 records a
// second would otherwise cost its proxy 100 writes a second per open page.
// With several engines (/health names them) a picker chooses the fleet, every engine's records merged (a trace
// per engine: each numbers its own iterations, so no per-iteration sum is honest), or one engine's stream.
'use strict';
(() => {
  const MAX_RECORDS = 2000;
  const REDRAW_MS = 500;
  const ENGINES_MS = 10000;  // how often the engine list is asked again (autoscaling adds and removes engines)
  const RANKS_POLL_MS = 2000;
  const MAX_FLAGS = 50;
  const KEY_STORE = 'kvfleet.apiKey';
  const PLOT_CONFIG = {displayModeBar: false, responsive: true};

  // the page's state; the browser tests read it
  const state = {
    records: [], firstIter: null, lastId: null, lastTimestamp: null, received: 0, duplicates: 0, connects: 0,
    resets: 0, live: false,
    dirty: false, redraws: 0, redrawMs: 0, views: new Set(), incomplete: 0, divergent: 0, epochs: {}, ranks: null,
    // engines: the ids /health names (null until asked); engine: the one picked, null for all of them;
    // cursor and latest: each engine's last record seen (the fleet view resumes and checks history per engine)
    engines: null, fleet: false, engine: null, cursor: {}, latest: {},
  };
  window.kvDashboard = state;
  const $ = (id) => document.getElementById(id);
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  // ---- API key: asked for on a 401, kept for the tab
  let apiKey = sessionStorage.getItem(KEY_STORE);
  const keyWaiters = [];
  const withKey = (headers) => (apiKey ? {...headers, Authorization: `Bearer ${apiKey}`} : headers);

  function askForKey() {
    $('auth-msg').textContent = apiKey ? 'that key was refused; another one?' : 'this server needs an API key';
    $('auth').hidden = false;
    $('auth-key').focus();
    return new Promise((resolve) => keyWaiters.push(resolve));
  }

  $('auth-form').addEventListener('submit', (event) => {
    event.preventDefault();
    apiKey = $('auth-key').value.trim();
    sessionStorage.setItem(KEY_STORE, apiKey);
    $('auth').hidden = true;
    keyWaiters.splice(0).forEach((resolve) => resolve());
  });

  async function getJSON(path) {
    for (;;) {
      const resp = await fetch(path, {headers: withKey({Accept: 'application/json'}), cache: 'no-store'});
      if (resp.status === 401) { await askForKey(); continue; }
      if (!resp.ok) throw new Error(`${path}: HTTP ${resp.status}`);
      return resp.json();
    }
  }

  // ---- engines
  const fleetView = () => state.fleet && state.engine === null;

  // a path with its query; `engine` first, as the picked engine's stream is named
  function url(path, params = {}, engine = state.engine) {
    const q = new URLSearchParams(engine === null ? params : {engine, ...params}).toString();
    return q ? `${path}?${q}` : path;
  }

  // /health is open (no key) and names the engines only when there are several (or the fleet autoscales); a 503
  // still names them. Asked again every ENGINES_MS: under autoscaling engines join, and leave marked `gone`
  async function discoverEngines() {
    const resp = await fetch('health', {headers: {Accept: 'application/json'}, cache: 'no-store'});
    const body = await resp.json().catch(() => ({}));
    const engines = body.engines || {};
    state.engines = [...new Set([...(state.engines || []), ...Object.keys(engines)])];
    state.fleet = body.engines !== undefined;  // the fleet's shape: several engines, or an autoscaled fleet of one
    if (!state.fleet) return;
    const picker = $('engine');
    for (const eid of state.engines) {
      const label = engines[eid]?.gone ? `${eid} (gone)` : eid;
      const option = [...picker.options].find((o) => o.value === eid);
      if (option) option.text = label;
      else picker.add(new Option(label, eid));
    }
    $('engine-picker').hidden = false;
  }

  let conn = null;  // the open stream's AbortController: the picker aborts it to switch streams
  $('engine').addEventListener('change', () => {
    state.engine = $('engine').value || null;
    resetView();
    if (conn) conn.abort();  // follow() reconnects at once, to the new stream
  });

  // what the page drew comes from one stream: another stream starts from nothing
  function resetView() {
    Object.assign(state, {records: [], firstIter: null, lastId: null, lastTimestamp: null, received: 0,
      duplicates: 0, incomplete: 0, divergent: 0, epochs: {}, ranks: null, cursor: {}, latest: {}, dirty: true});
    $('flags').replaceChildren();
    $('flag-counts').textContent = 'incomplete records 0 · tp divergence 0';
    $('hit-rate').textContent = '–';
    $('last-iter').textContent = '–';
    $('ranks').replaceChildren();
    document.querySelectorAll('.chart').forEach((el) => Plotly.purge(el));
  }

  // ---- the stream
  function setLive(live, why) {
    state.live = live;
    $('status').textContent = live ? 'live' : `reconnecting (${why})`;
    $('status').className = `status ${live ? 'live' : 'down'}`;
  }

  // A fresh app numbers its iterations from 0 again, and resuming after Last-Event-ID would wait forever:
  // before resuming, check that the server still holds the very record we saw last (in the fleet view, each
  // engine's: an engine with another history starts again alone, left out of the cursor sent back).
  async function checkHistory() {
    if (fleetView()) {
      for (const [eid, seen] of Object.entries(state.cursor)) {
        if (!(await holds(seen, eid))) restartEngine(eid);
      }
      return;
    }
    if (await holds({iter: state.lastId, timestamp: state.lastTimestamp}, state.engine)) return;
    state.resets += 1;
    addFlag(`iter ${state.lastId}`,
            'the server has another history (a fresh app): starting again from its oldest record');
    state.records = [];
    state.firstIter = state.lastId = state.lastTimestamp = null;
    state.epochs = {};
  }

  async function holds(seen, engine) {
    const got = await getJSON(url('stats', {since: seen.iter - 1, limit: 1}, engine));
    return got.length === 1 && got[0].iter === seen.iter && got[0].timestamp === seen.timestamp;
  }

  function restartEngine(eid) {
    state.resets += 1;
    addFlag(eid, 'this engine has another history (a fresh aggregator): starting it again from its oldest record');
    state.records = state.records.filter((r) => r.engineId !== eid);
    delete state.cursor[eid];
    delete state.latest[eid];
    delete state.epochs[eid];
    const left = Object.entries(state.cursor).map(([e, c]) => `${e}:${c.iter}`);
    state.lastId = left.length ? left.join(',') : null;
  }

  async function follow() {
    let backoff = 500;
    for (;;) {
      conn = new AbortController();
      const {signal} = conn;
      try {
        if (state.engines === null) await discoverEngines();
        if (state.lastId !== null) await checkHistory();
        const headers = withKey({Accept: 'text/event-stream'});
        if (state.lastId !== null) headers['Last-Event-ID'] = String(state.lastId);
        const resp = await fetch(url('stats/stream', {interval_ms: REDRAW_MS}), {headers, cache: 'no-store', signal});
        if (resp.status === 401) { await askForKey(); continue; }
        if (!resp.ok || !resp.body) throw new Error(`HTTP ${resp.status}`);
        state.connects += 1;
        backoff = 500;
        setLive(true);
        await readEvents(resp.body, signal);
        throw new Error('the stream ended');
      } catch (err) {
        if (signal.aborted) continue;  // the picker switched streams: no backoff
        setLive(false, err.message);
      }
      await sleep(backoff * (0.75 + Math.random() / 2));
      backoff = Math.min(backoff * 2, 10000);
    }
  }

  // SSE as the WHATWG spec reads it (our server ends lines with \n): a blank line dispatches the event
  async function readEvents(body, signal) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = '';
    let data = [];
    let event = '';
    let id = null;
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return;
      if (signal.aborted) throw new Error('switched');  // a read that resolved just before the abort
      const lines = (buf + value).split('\n');
      buf = lines.pop();
      for (let line of lines) {
        if (line.endsWith('\r')) line = line.slice(0, -1);
        if (line === '') {
          if (data.length && event === 'stats') ingest(JSON.parse(data.join('\n')), id);
          data = [];
          event = '';
        } else if (line[0] !== ':') {
          const colon = line.indexOf(':');
          const field = colon < 0 ? line : line.slice(0, colon);
          let value = colon < 0 ? '' : line.slice(colon + 1);
          if (value[0] === ' ') value = value.slice(1);
          if (field === 'data') data.push(value);
          else if (field === 'event') event = value;
          else if (field === 'id') id = value;
        }
      }
    }
  }

  // where a flag happened: the fleet view names the engine, whose iterations those are
  const flagAt = (rec) => (fleetView() ? `${rec.engineId} iter ${rec.iter}` : `iter ${rec.iter}`);

  // the merged stream repeats no engine's record: an older one means that engine's aggregator came back with
  // another history, and the server follows it from its oldest record again (docs/http-api.md)
  function olderThanSeen(rec) {
    const seen = state.cursor[rec.engineId];
    return seen !== undefined && rec.iter <= seen.iter;
  }

  function ingest(rec, id) {
    const fleet = fleetView();
    if (fleet && olderThanSeen(rec)) restartEngine(rec.engineId);
    if (!fleet && state.lastId !== null && rec.iter <= state.lastId) { state.duplicates += 1; return; }
    if (state.firstIter === null) state.firstIter = rec.iter;
    state.lastId = id === null ? rec.iter : fleet ? id : Number(id);  // the fleet's id is the vector cursor
    state.lastTimestamp = rec.timestamp;
    if (fleet) {
      state.cursor[rec.engineId] = {iter: rec.iter, timestamp: rec.timestamp};
      state.latest[rec.engineId] = rec;  // the fleet's big number sums each engine's newest cumulative counts
    }
    state.received += 1;
    state.records.push(rec);
    if (rec.complete === false) {
      state.incomplete += 1;
      addFlag(flagAt(rec), `incomplete: ranks ${(rec.missingRanks || []).join(', ')} missing`);
    }
    const div = rec.tpDivergence || [];
    if (div.length) {
      state.divergent += 1;
      const d = div[0];
      addFlag(flagAt(rec), `tp divergence (${div.length}): dp ${d.dpRank} tp ${d.tpRank} ${d.view} ${d.field}: ` +
              `expected ${d.expected}, got ${d.got}`);
    }
    (rec.errors || []).forEach((e) => addFlag(flagAt(rec), `error: ${typeof e === 'string' ? e : JSON.stringify(e)}`));
    const key = fleet ? rec.engineId : '';
    if (state.epochs[key] !== undefined && rec.aggregatorEpoch !== state.epochs[key]) {
      addFlag(flagAt(rec), `aggregator restarted (epoch ${state.epochs[key]} -> ${rec.aggregatorEpoch})`, false);
    }
    state.epochs[key] = rec.aggregatorEpoch;
    for (const w of Object.keys(rec.kvCacheIterationStats || {})) addView(`w:${w}`, `window ${w}`);
    for (const g of Object.keys(rec.kvCacheIterationStatsByPoolGroup || {})) addView(`g:${g}`, `pool group ${g}`);
    state.dirty = true;
  }

  function addFlag(where, text, bad = true) {
    const li = document.createElement('li');
    li.textContent = `${where}: ${text}`;
    if (bad) li.className = 'bad';
    $('flags').prepend(li);
    while ($('flags').children.length > MAX_FLAGS) $('flags').lastChild.remove();
    $('flag-counts').textContent = `incomplete records ${state.incomplete} · tp divergence ${state.divergent}`;
  }

  function addView(value, label) {
    if (state.views.has(value)) return;
    state.views.add(value);
    $('view').add(new Option(label, value));
  }
  $('view').addEventListener('change', () => { state.dirty = true; redraw(); });

  // ---- what one record says in the chosen view
  const sum = (objs, field) => objs.reduce((acc, o) => acc + (o[field] || 0), 0);

  function pick(rec, view) {
    const windows = rec.kvCacheIterationStats || {};
    const groups = rec.kvCacheIterationStatsByPoolGroup || {};
    if (view.startsWith('w:')) {  // a window bucket carries reuse, gauges and bytes itself
      const b = windows[view.slice(2)] || {};
      return {reuse: [b], pools: [b]};
    }
    if (view.startsWith('g:')) {  // a pool group: its gauges and bytes, its life cycles' reuse
      const g = view.slice(2);
      const lcs = Object.values(rec.kvCacheIterationStatsByLifecycle || {}).filter((l) => String(l.poolGroupId) === g);
      return {reuse: lcs, pools: groups[g] ? [groups[g]] : []};
    }
    // everything: window buckets partition the life cycles; pool groups partition the slots
    return {reuse: Object.values(windows), pools: Object.values(groups)};
  }

  function hitRate(reused, missed) {  // docs/stats.md: 0 when nothing was reused
    return reused === 0 || reused + missed === 0 ? 0 : reused / (reused + missed);
  }

  // ---- drawing
  const layout = (extra) => ({
    margin: {l: 50, r: 50, t: 8, b: 30}, legend: {orientation: 'h', y: -0.18}, uirevision: 'keep',
    datarevision: state.redraws, xaxis: {title: {text: ''}}, ...extra,
  });
  const line = (name, x, y, extra) => ({type: 'scatter', mode: 'lines', name, x, y, ...extra});

  // what to draw: one series of records, or in the fleet view one per engine (eid names its traces)
  function series() {
    if (!fleetView()) return [{eid: null, recs: state.records}];
    const by = new Map(state.engines.map((eid) => [eid, []]));
    for (const r of state.records) {
      if (!by.has(r.engineId)) by.set(r.engineId, []);  // joined since /health was last asked
      by.get(r.engineId).push(r);
    }
    return [...by].filter(([, recs]) => recs.length).map(([eid, recs]) => ({eid, recs}));
  }
  const named = (name, eid) => (eid === null ? name : `${name} · ${eid}`);
  // each engine stacks on its own: another engine's iteration i is another moment
  const stacker = (eid) => (name, x, y) => line(named(name, eid), x, y, {stackgroup: eid ?? 'one'});

  function drawBig(recs) {
    let s = recs[recs.length - 1].kvCacheStats || {};
    let iter = recs[recs.length - 1].iter;
    if (fleetView()) {  // the fleet's counts: each engine's newest cumulative counts, summed
      const latest = Object.values(state.latest).map((r) => r.kvCacheStats || {});
      s = {reusedBlocks: sum(latest, 'reusedBlocks'), missedBlocks: sum(latest, 'missedBlocks')};
      iter = state.lastId;
    }
    const reused = s.reusedBlocks || 0;
    const missed = s.missedBlocks || 0;
    const big = $('hit-rate');
    big.textContent = `${(100 * hitRate(reused, missed)).toFixed(1)}%`;
    Object.assign(big.dataset, {iter, reused, missed});
    $('hit-detail').textContent = `reused ${reused} / (reused + missed ${missed}) blocks since start` +
      (fleetView() ? `, ${Object.keys(state.latest).length} engines` : '');
    $('last-iter').textContent = iter;
    $('window-info').textContent = `${state.records.length} records in view`;
  }

  function drawCharts(all, view) {
    const hit = [];
    const reuseTraces = [];
    const blocks = [];
    const bytes = [];
    for (const {eid, recs} of all) {
      const stacked = stacker(eid);
      const x = recs.map((r) => r.iter);
      const picked = recs.map((r) => pick(r, view));
      const reuse = (f) => picked.map((p) => sum(p.reuse, f));
      const gauge = (f) => picked.map((p) => sum(p.pools, f));
      // reuse is drawn for the iterations that matched or allocated prompt blocks (decode-only steps have none)
      const reused = reuse('iterReusedBlocks');
      const missed = reuse('iterMissedBlocks');
      const active = x.map((_, i) => i).filter((i) => reused[i] + missed[i] > 0);
      const at = (ys) => active.map((i) => ys[i]);
      const xa = at(x);
      hit.push(line(named('hit rate %', eid), xa, active.map((i) => 100 * hitRate(reused[i], missed[i])), {}));
      reuseTraces.push(stacked('full reused', xa, at(reuse('iterFullReusedBlocks'))),
        stacked('partial reused', xa, at(reuse('iterPartialReusedBlocks'))), stacked('missed', xa, at(missed)));

      const used = gauge('primaryUsedNumBlocks');
      const evictable = gauge('primaryEvictableNumBlocks');
      const free = gauge('primaryFreeNumBlocks').map((f, i) => f - evictable[i]);  // free counts evictable
      blocks.push(stacked('primary used', x, used), stacked('primary evictable', x, evictable),
        stacked('primary free', x, free), line(named('secondary used', eid), x, gauge('secondaryUsedNumBlocks'),
          {line: {dash: 'dot'}}));
      bytes.push(...bytesTraces(recs, picked, eid));
    }
    Plotly.react('chart-hit', hit, layout({yaxis: {range: [0, 100], ticksuffix: '%'}, showlegend: all.length > 1}),
                 PLOT_CONFIG);
    Plotly.react('chart-reuse', reuseTraces, layout({yaxis: {title: {text: 'blocks'}}}), PLOT_CONFIG);
    Plotly.react('chart-blocks', blocks, layout({yaxis: {title: {text: 'blocks'}}}), PLOT_CONFIG);
    Plotly.react('chart-bytes', bytes, layout({yaxis: {title: {text: 'bytes/s'}}, xaxis: {type: 'date'}}),
                 PLOT_CONFIG);
  }

  // bytes per wall-clock second: each record's bytes go to the second its step finished in; seconds without a
  // record moved nothing (0), up to MAX_IDLE_S of them, past which the line breaks
  const MAX_IDLE_S = 600;
  function bytesTraces(recs, picked, eid) {
    const fields = ['iterOnboardBytes', 'iterOffloadBytes', 'iterHostDroppedBytes'];
    const t = [];
    const ys = fields.map(() => []);
    const push = (sec, v) => { t.push(new Date(sec * 1000)); ys.forEach((y) => y.push(v)); };
    recs.forEach((r, i) => {
      const sec = Math.floor(Date.parse(r.timestamp) / 1000);
      if (Number.isNaN(sec)) return;
      const prev = t.length ? t[t.length - 1].getTime() / 1000 : sec;
      if (!t.length) push(sec, 0);
      else if (sec - prev > MAX_IDLE_S) { push(prev + 1, null); push(sec, 0); }
      else for (let s = prev + 1; s <= sec; s++) push(s, 0);
      fields.forEach((f, k) => { ys[k][ys[k].length - 1] += sum(picked[i].pools, f); });
    });
    const names = ['onboard (host → primary)', 'offload (primary → host)', 'dropped from the last tier'];
    return names.map((n, k) => line(named(n, eid), t, ys[k]));
  }

  function drawRequests(all) {
    const has = all.some(({recs}) => recs.some((r) => r.numActiveRequests !== undefined));
    $('sec-requests').hidden = !has;
    if (!has) return;
    const traces = all.flatMap(({eid, recs}) => {
      const x = recs.map((r) => r.iter);
      return [line(named('running', eid), x, recs.map((r) => r.numActiveRequests)),
        line(named('queued', eid), x, recs.map((r) => r.numQueuedRequests)),
        line(named('iteration ms', eid), x, recs.map((r) => r.iterLatencyMS), {yaxis: 'y2', line: {dash: 'dot'}})];
    });
    Plotly.react('chart-requests', traces,
                 layout({yaxis: {title: {text: 'requests'}}, yaxis2: {title: {text: 'ms'}, overlaying: 'y',
                   side: 'right'}}), PLOT_CONFIG);
  }

  function drawRouting(all) {
    const routed = all.map(({eid, recs}) => ({eid, recs: recs.filter((r) => r.routing)}))
      .filter(({recs}) => recs.length);
    $('sec-routing-groups').hidden = $('sec-routing-reuse').hidden = !routed.length;
    if (!routed.length) return;
    const bars = [];
    const reuse = [];
    for (const {eid, recs} of routed) {
      const perGroup = {};
      for (const r of recs) {
        for (const [g, n] of Object.entries(r.routing.perGroupRequests || {})) perGroup[g] = (perGroup[g] || 0) + n;
      }
      const groups = Object.keys(perGroup).sort((a, b) => a - b);
      bars.push({type: 'bar', x: groups.map((g) => named(`dp ${g}`, eid)), y: groups.map((g) => perGroup[g]),
        ...(eid === null ? {} : {name: eid})});
      let predicted = 0;
      let realized = 0;
      const x = recs.map((r) => r.iter);
      const p = recs.map((r) => (predicted += r.routing.predictedReusedBlocks || 0));
      const q = recs.map((r) => (realized += r.routing.realizedReusedBlocks || 0));
      reuse.push(line(named('predicted', eid), x, p), line(named('realized', eid), x, q));
    }
    Plotly.react('chart-routing-groups', bars, layout({showlegend: false, xaxis: {type: 'category'}}), PLOT_CONFIG);
    const policy = routed.at(-1).recs.at(-1).routing.policy;
    Plotly.react('chart-routing-reuse', reuse, layout({yaxis: {title: {text: 'blocks'}},
      title: {text: `policy ${policy}`, font: {size: 12}, y: 0.97}}), PLOT_CONFIG);
  }

  // the fleet view: /stats/ranks lists every engine's ranks, {engine id: {rank: ...}}
  function drawRanks() {
    const cells = fleetView()
      ? state.engines.flatMap((eid) => rankCells((state.ranks || {})[eid], state.latest[eid], eid))
      : rankCells(state.ranks, state.records[state.records.length - 1], null);
    if (!cells.length) return;
    $('ranks').replaceChildren(...cells);
    $('ranks').classList.remove('muted');
  }

  function rankCells(ranks, last, eid) {
    const n = (last && last.numRanks) || Object.keys(ranks || {}).length;
    const missing = new Set(last ? last.missingRanks || [] : []);
    const cells = [];
    for (let r = 0; r < n; r++) {
      const info = (ranks || {})[String(r)] || {};
      const s = (info.record || {}).kvCacheStats || {};
      const pct = s.maxNumBlocks ? (100 * s.usedNumBlocks) / s.maxNumBlocks : 0;
      const reported = Boolean(info.record);  // a rank that never reported yet is not down
      const down = missing.has(r) || (reported && info.healthy === false);
      const cell = document.createElement('div');
      cell.className = down ? 'rank down' : 'rank';
      Object.assign(cell.dataset, {rank: r, reported}, eid === null ? {} : {engine: eid});
      cell.style.background = `linear-gradient(to top, #9ecae1 ${pct}%, #fff ${pct}%)`;
      const where = info.dp_rank === undefined ? '' : ` dp${info.dp_rank}/tp${info.tp_rank}`;
      const what = down ? 'down' : reported ? `${pct.toFixed(0)}% used` : 'no report yet';
      for (const [tag, text] of [['b', named(`rank ${r}`, eid)], ['span', where], ['span', what]]) {
        cell.append(Object.assign(document.createElement(tag), {textContent: text}));
      }
      cells.push(cell);
    }
    return cells;
  }

  function redraw() {
    if (!state.dirty || document.hidden) return;  // a background tab draws when it is shown again
    state.dirty = false;
    state.redraws += 1;
    const t0 = performance.now();
    const keep = MAX_RECORDS * (fleetView() ? state.engines.length : 1);  // the fleet: 2,000 per engine
    if (state.records.length > keep) state.records.splice(0, state.records.length - keep);
    drawRanks();
    if (!state.records.length) return;
    const all = series();
    drawBig(state.records);
    drawCharts(all, $('view').value);
    drawRequests(all);
    drawRouting(all);
    state.redrawMs = performance.now() - t0;
  }

  async function pollRanks() {
    for (;;) {
      try {
        const path = url('stats/ranks');
        const got = await getJSON(path);
        if (path === url('stats/ranks')) state.ranks = got;  // not a switched-away engine's answer
        state.dirty = true;
      } catch (err) {
        // the stream's status shows what is wrong; the strip keeps its last picture
      }
      await sleep(RANKS_POLL_MS);
    }
  }

  setInterval(redraw, REDRAW_MS);
  setInterval(() => { if (state.engines !== null) discoverEngines().catch(() => {}); }, ENGINES_MS);
  document.addEventListener('visibilitychange', redraw);
  follow();
  pollRanks();
})();
