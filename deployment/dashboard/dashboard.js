// kvfleet dashboard: follows /stats/stream and draws the cluster's KV cache with plotly.js.
// The stream is read with fetch() and a small SSE parser, not EventSource, because EventSource cannot send
// the Authorization header; the parser sends Last-Event-ID itself and reconnects with backoff. Records are
// batched: the charts are redrawn at most every REDRAW_MS from the last MAX_RECORDS records (Plotly.react),
// and the server is asked for the records of each REDRAW_MS in one write (interval_ms): a GPU's 100 records a
// second would otherwise cost its proxy 100 writes a second per open page.
'use strict';
(() => {
  const MAX_RECORDS = 2000;
  const REDRAW_MS = 500;
  const RANKS_POLL_MS = 2000;
  const MAX_FLAGS = 50;
  const KEY_STORE = 'kvfleet.apiKey';
  const PLOT_CONFIG = {displayModeBar: false, responsive: true};

  // the page's state; the browser tests read it
  const state = {
    records: [], firstIter: null, lastId: null, lastTimestamp: null, received: 0, duplicates: 0, connects: 0,
    resets: 0, live: false,
    dirty: false, redraws: 0, redrawMs: 0, views: new Set(), incomplete: 0, divergent: 0, epoch: null, ranks: null,
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

  // ---- the stream
  function setLive(live, why) {
    state.live = live;
    $('status').textContent = live ? 'live' : `reconnecting (${why})`;
    $('status').className = `status ${live ? 'live' : 'down'}`;
  }

  // A fresh app numbers its iterations from 0 again, and resuming after Last-Event-ID would wait forever:
  // before resuming, check that the server still holds the very record we saw last.
  async function checkHistory() {
    const got = await getJSON(`stats?since=${state.lastId - 1}&limit=1`);
    if (got.length === 1 && got[0].iter === state.lastId && got[0].timestamp === state.lastTimestamp) return;
    state.resets += 1;
    addFlag(state.lastId, 'the server has another history (a fresh app): starting again from its oldest record');
    state.records = [];
    state.firstIter = state.lastId = state.lastTimestamp = state.epoch = null;
  }

  async function follow() {
    let backoff = 500;
    for (;;) {
      try {
        if (state.lastId !== null) await checkHistory();
        const headers = withKey({Accept: 'text/event-stream'});
        if (state.lastId !== null) headers['Last-Event-ID'] = String(state.lastId);
        const resp = await fetch(`stats/stream?interval_ms=${REDRAW_MS}`, {headers, cache: 'no-store'});
        if (resp.status === 401) { await askForKey(); continue; }
        if (!resp.ok || !resp.body) throw new Error(`HTTP ${resp.status}`);
        state.connects += 1;
        backoff = 500;
        setLive(true);
        await readEvents(resp.body);
        throw new Error('the stream ended');
      } catch (err) {
        setLive(false, err.message);
      }
      await sleep(backoff * (0.75 + Math.random() / 2));
      backoff = Math.min(backoff * 2, 10000);
    }
  }

  // SSE as the WHATWG spec reads it (our server ends lines with \n): a blank line dispatches the event
  async function readEvents(body) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = '';
    let data = [];
    let event = '';
    let id = null;
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return;
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

  function ingest(rec, id) {
    if (state.lastId !== null && rec.iter <= state.lastId) { state.duplicates += 1; return; }
    if (state.firstIter === null) state.firstIter = rec.iter;
    state.lastId = id === null ? rec.iter : Number(id);
    state.lastTimestamp = rec.timestamp;
    state.received += 1;
    state.records.push(rec);
    if (rec.complete === false) {
      state.incomplete += 1;
      addFlag(rec.iter, `incomplete: ranks ${(rec.missingRanks || []).join(', ')} missing`);
    }
    const div = rec.tpDivergence || [];
    if (div.length) {
      state.divergent += 1;
      const d = div[0];
      addFlag(rec.iter, `tp divergence (${div.length}): dp ${d.dpRank} tp ${d.tpRank} ${d.view} ${d.field}: ` +
              `expected ${d.expected}, got ${d.got}`);
    }
    (rec.errors || []).forEach((e) => addFlag(rec.iter, `error: ${typeof e === 'string' ? e : JSON.stringify(e)}`));
    if (state.epoch !== null && rec.aggregatorEpoch !== state.epoch) {
      addFlag(rec.iter, `aggregator restarted (epoch ${state.epoch} -> ${rec.aggregatorEpoch})`, false);
    }
    state.epoch = rec.aggregatorEpoch;
    for (const w of Object.keys(rec.kvCacheIterationStats || {})) addView(`w:${w}`, `window ${w}`);
    for (const g of Object.keys(rec.kvCacheIterationStatsByPoolGroup || {})) addView(`g:${g}`, `pool group ${g}`);
    state.dirty = true;
  }

  function addFlag(iter, text, bad = true) {
    const li = document.createElement('li');
    li.textContent = `iter ${iter}: ${text}`;
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
  const stacked = (name, x, y) => line(name, x, y, {stackgroup: 'one'});

  function drawBig(last) {
    const s = last.kvCacheStats || {};
    const reused = s.reusedBlocks || 0;
    const missed = s.missedBlocks || 0;
    const big = $('hit-rate');
    big.textContent = `${(100 * hitRate(reused, missed)).toFixed(1)}%`;
    Object.assign(big.dataset, {iter: last.iter, reused, missed});
    $('hit-detail').textContent = `reused ${reused} / (reused + missed ${missed}) blocks since start`;
    $('last-iter').textContent = last.iter;
    $('window-info').textContent = `${state.records.length} records in view`;
  }

  function drawCharts(recs, view) {
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
    Plotly.react('chart-hit', [line('hit rate %', xa, active.map((i) => 100 * hitRate(reused[i], missed[i])),
      {})],
    layout({yaxis: {range: [0, 100], ticksuffix: '%'}, showlegend: false}), PLOT_CONFIG);
    Plotly.react('chart-reuse', [stacked('full reused', xa, at(reuse('iterFullReusedBlocks'))),
      stacked('partial reused', xa, at(reuse('iterPartialReusedBlocks'))), stacked('missed', xa, at(missed))],
    layout({yaxis: {title: {text: 'blocks'}}}), PLOT_CONFIG);

    const used = gauge('primaryUsedNumBlocks');
    const evictable = gauge('primaryEvictableNumBlocks');
    const free = gauge('primaryFreeNumBlocks').map((f, i) => f - evictable[i]);  // free counts evictable
    Plotly.react('chart-blocks', [stacked('primary used', x, used), stacked('primary evictable', x, evictable),
      stacked('primary free', x, free), line('secondary used', x, gauge('secondaryUsedNumBlocks'),
        {line: {dash: 'dot'}})], layout({yaxis: {title: {text: 'blocks'}}}), PLOT_CONFIG);

    drawBytes(recs, picked);
  }

  // bytes per wall-clock second: each record's bytes go to the second its step finished in; seconds without a
  // record moved nothing (0), up to MAX_IDLE_S of them, past which the line breaks
  const MAX_IDLE_S = 600;
  function drawBytes(recs, picked) {
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
    Plotly.react('chart-bytes', names.map((n, k) => line(n, t, ys[k])),
                 layout({yaxis: {title: {text: 'bytes/s'}}, xaxis: {type: 'date'}}), PLOT_CONFIG);
  }

  function drawRequests(recs) {
    const has = recs.some((r) => r.numActiveRequests !== undefined);
    $('sec-requests').hidden = !has;
    if (!has) return;
    const x = recs.map((r) => r.iter);
    Plotly.react('chart-requests', [line('running', x, recs.map((r) => r.numActiveRequests)),
      line('queued', x, recs.map((r) => r.numQueuedRequests)),
      line('iteration ms', x, recs.map((r) => r.iterLatencyMS), {yaxis: 'y2', line: {dash: 'dot'}})],
    layout({yaxis: {title: {text: 'requests'}}, yaxis2: {title: {text: 'ms'}, overlaying: 'y', side: 'right'}}),
    PLOT_CONFIG);
  }

  function drawRouting(recs) {
    const routed = recs.filter((r) => r.routing);
    $('sec-routing-groups').hidden = $('sec-routing-reuse').hidden = !routed.length;
    if (!routed.length) return;
    const perGroup = {};
    for (const r of routed) {
      for (const [g, n] of Object.entries(r.routing.perGroupRequests || {})) perGroup[g] = (perGroup[g] || 0) + n;
    }
    const groups = Object.keys(perGroup).sort((a, b) => a - b);
    Plotly.react('chart-routing-groups', [{type: 'bar', x: groups.map((g) => `dp ${g}`),
      y: groups.map((g) => perGroup[g])}], layout({showlegend: false, xaxis: {type: 'category'}}), PLOT_CONFIG);
    let predicted = 0;
    let realized = 0;
    const x = routed.map((r) => r.iter);
    const p = routed.map((r) => (predicted += r.routing.predictedReusedBlocks || 0));
    const q = routed.map((r) => (realized += r.routing.realizedReusedBlocks || 0));
    Plotly.react('chart-routing-reuse', [line('predicted', x, p), line('realized', x, q)],
                 layout({yaxis: {title: {text: 'blocks'}}, title: {text: `policy ${routed.at(-1).routing.policy}`,
                   font: {size: 12}, y: 0.97}}), PLOT_CONFIG);
  }

  function drawRanks() {
    const last = state.records[state.records.length - 1];
    const n = last ? last.numRanks : Object.keys(state.ranks || {}).length;
    if (!n) return;
    const missing = new Set(last ? last.missingRanks || [] : []);
    const cells = [];
    for (let r = 0; r < n; r++) {
      const info = (state.ranks || {})[String(r)] || {};
      const s = (info.record || {}).kvCacheStats || {};
      const pct = s.maxNumBlocks ? (100 * s.usedNumBlocks) / s.maxNumBlocks : 0;
      const reported = Boolean(info.record);  // a rank that never reported yet is not down
      const down = missing.has(r) || (reported && info.healthy === false);
      const cell = document.createElement('div');
      cell.className = down ? 'rank down' : 'rank';
      Object.assign(cell.dataset, {rank: r, reported});
      cell.style.background = `linear-gradient(to top, #9ecae1 ${pct}%, #fff ${pct}%)`;
      const where = info.dp_rank === undefined ? '' : ` dp${info.dp_rank}/tp${info.tp_rank}`;
      const what = down ? 'down' : reported ? `${pct.toFixed(0)}% used` : 'no report yet';
      cell.innerHTML = `<b>rank ${r}</b><span>${where}</span><span>${what}</span>`;
      cells.push(cell);
    }
    $('ranks').replaceChildren(...cells);
    $('ranks').classList.remove('muted');
  }

  function redraw() {
    if (!state.dirty || document.hidden) return;  // a background tab draws when it is shown again
    state.dirty = false;
    state.redraws += 1;
    const t0 = performance.now();
    if (state.records.length > MAX_RECORDS) state.records.splice(0, state.records.length - MAX_RECORDS);
    const recs = state.records;
    drawRanks();
    if (!recs.length) return;
    drawBig(recs[recs.length - 1]);
    drawCharts(recs, $('view').value);
    drawRequests(recs);
    drawRouting(recs);
    state.redrawMs = performance.now() - t0;
  }

  async function pollRanks() {
    for (;;) {
      try {
        state.ranks = await getJSON('stats/ranks');
        state.dirty = true;
      } catch (err) {
        // the stream's status shows what is wrong; the strip keeps its last picture
      }
      await sleep(RANKS_POLL_MS);
    }
  }

  setInterval(redraw, REDRAW_MS);
  document.addEventListener('visibilitychange', redraw);
  follow();
  pollRanks();
})();
