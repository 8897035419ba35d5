"""The page of a run report (retrograd.reports.run_report): a Jinja template with autoescaping (rollout
text is untrusted model output), plotly.js embedded from the installed plotly package, and a
few lines of JavaScript that draw the figures and filter the rollout browser."""

from __future__ import annotations

import functools

import jinja2

PAGE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>retrograd report: {{ run }}</title>
<style>
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px; padding: 0 1em; color: #222; }
h1 { font-size: 1.4em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
.meta { color: #555; } .note { color: #555; font-size: 0.9em; }
.figures { display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap: 0.5em; }
table { border-collapse: collapse; width: 100%; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.45em; vertical-align: top; text-align: left; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre.text { white-space: pre-wrap; word-break: break-word; margin: 0; max-height: 16em; overflow: auto; font-size: 0.85em; }
.turn { border-left: 3px solid #9ab; padding-left: 0.4em; margin-bottom: 0.4em; }
.call { background: #f6f6f6; margin: 0.2em 0; padding: 0.2em; } .error { color: #a00; }
.no { color: #a60; } .yes { color: #070; }
.controls { display: flex; flex-wrap: wrap; gap: 1em; align-items: center; margin: 0.6em 0; }
</style>
</head>
<body>
<h1>retrograd run report</h1>
<p class="meta">run <code>{{ run }}</code> · {{ algorithm }} · {{ n_records }} records, last optimizer step {{ last_step }} ·
written {{ generated }} (refreshed at every checkpoint while <code>retrograd train</code> runs; <code>retrograd report</code> rewrites it)</p>
{% if skipped %}<p id="skipped" class="error">Left out as malformed (not as retrograd writes them):
{{ skipped | join("; ") }}.</p>{% endif %}

<h2>Curves</h2>
{% if curves %}
<p class="note">Lines are training records, diamonds evaluation points{% if timeline %}, against the update
(an update whose groups all had equal rewards takes no optimizer step){% else %}, against the optimizer step{% endif %}.</p>
<div class="figures">{% for fig in curves %}<div id="{{ fig.id }}" class="figure"></div>{% endfor %}</div>
{% else %}<p>The metrics hold no step records yet.</p>{% endif %}

{% if timeline %}
<h2>Updates</h2>
<p class="note">{% if counters | length < n_updates %}{{ counters | length }} of {{ n_updates }} updates, evenly spread over the run
(at most {{ timeline_cap }}). {% endif %}Each update's phases ({{ phases | join(", ") }}) as bars on the run's clock; "other" is the rest of
the update (data preparation, tokenization, bookkeeping); gaps between updates are evaluation, checkpoints and
writing records.</p>
<div id="{{ timeline.id }}" class="figure"></div>
<table id="counters">
<thead><tr><th>update</th><th>seconds</th><th>zero-advantage groups (discarded)</th><th>truncated completions</th>
<th>dropped completions</th><th>canceled rollouts</th><th>waiting for batch</th><th>tokens/s</th></tr></thead>
<tbody>
{% for c in counters %}<tr><td class="num">{{ c["update"] }}</td><td class="num">{{ c.seconds }}</td><td class="num">{{ c.groups }}</td>
<td class="num">{{ c.truncated }}</td><td class="num">{{ c.dropped }}</td><td class="num">{{ c.canceled }}</td>
<td class="num">{{ c.waiting }}</td><td class="num">{{ c.tokens_per_second }}</td></tr>
{% endfor %}</tbody></table>
<p class="note">Counts are "n / total" from the run's rollouts, or the recorded fractions for updates they do not hold.
Dropped: left out of training for a reason other than a zero advantage (truncated with masking, failed, unscored).
Canceled rollouts and waiting for a batch are always 0 here, and recorded as such: retrograd samples and trains in
turns (synchronously), so no rollout is abandoned and no update waits for one.</p>
{% endif %}

{% if browser.total %}
<h2>Rollouts</h2>
<p class="note">{{ browser.shown | length }} of {{ browser.total }} rollouts: {{ browser.updates_shown | length }} of
{{ browser.updates_total }} updates, whole, spread over the run (at most {{ rows_cap }} rows; texts cut at {{ text_cap }} characters).</p>
<div class="controls">
<label>update <select id="f-update"><option value="">all</option>{% for u in browser.updates_shown %}<option>{{ u }}</option>{% endfor %}</select></label>
<label>reward from <input id="f-min" type="number" step="any" size="6"></label>
<label>to <input id="f-max" type="number" step="any" size="6"></label>
<label>trained <select id="f-trained"><option value="">all</option><option value="yes">yes</option><option value="no">no</option></select></label>
<button id="f-prev" type="button">previous</button><button id="f-next" type="button">next</button>
<span id="f-status"></span>
</div>
<table id="rollouts">
<thead><tr><th>update</th><th>group</th><th>prompt</th><th>completion</th><th>tokens</th><th>reward</th><th>advantage</th><th>trained</th></tr></thead>
<tbody>
{% for r in browser.shown %}<tr data-update="{{ r["update"] }}" data-reward="{{ '' if r.reward is none else r.reward }}" data-trained="{{ '' if r.trained is none else 'yes' if r.trained else 'no' }}">
<td class="num">{{ r["update"] }}</td><td class="num">{{ r.group }}</td><td><pre class="text">{{ r.prompt }}</pre></td>
<td>{% if r.turns %}{% for t in r.turns %}<div class="turn"><pre class="text">{{ t.assistant }}</pre>
{% for c in t.calls %}<div class="call{{ ' error' if c.is_error }}">→ <b>{{ c.name }}</b>(<code>{{ c.arguments }}</code>){% if c.reward is not none %} reward {{ c.reward }}{% endif %}
<pre class="text">{{ c.observation }}</pre></div>{% endfor %}{% if t.error %}<div class="error">{{ t.error }}</div>{% endif %}
<span class="note">turn ended: {{ t.finish }}</span></div>{% endfor %}{% else %}<pre class="text">{{ r.completion }}</pre>{% endif %}</td>
<td class="num">{{ '-' if r.tokens is none else r.tokens }}{% if r.truncated %} (truncated){% endif %}</td>
<td class="num">{{ '-' if r.reward is none else '%.4g' % r.reward }}</td>
<td class="num">{{ '-' if r.advantage is none else '%.4g' % r.advantage }}{% if r.teacher_kl is not none %} (sampler − teacher log-prob {{ '%.3g' % r.teacher_kl }}){% endif %}</td>
<td>{% if r.trained is none %}-{% elif r.trained %}<span class="yes">yes</span>{% else %}<span class="no">no: {{ r.skip_reason }}</span>{% endif %}</td></tr>
{% endfor %}</tbody></table>
{% endif %}

{% if evaluation %}
<h2>Evaluation</h2>
<p class="note">From <code>{{ evaluation_file }}</code> (<code>retrograd eval</code>): the base and each adapter on the same items;
Δ is the adapter's mean difference per item with its 95% paired bootstrap interval.</p>
<table id="evaluation"><thead><tr><th>task</th><th>metric</th>{% for m in evaluation[0].models %}<th>{{ m }}</th>{% endfor %}</tr></thead>
<tbody>{% for t in evaluation %}{% for metric in t.metrics %}<tr><td>{% if loop.first %}{{ t.task }}{% if t.kind %} ({{ t.kind }}{% if t["items"] is not none %}, {{ t["items"] }} items{% endif %}){% endif %}{% endif %}</td>
<td>{{ metric.name }}</td>{% for v in metric["values"] %}<td class="num">{{ '%.4f' % v }}</td>{% endfor %}</tr>{% endfor %}
{% if t.differences %}<tr><td></td><td>Δ, 95% interval</td><td></td>{% for d in t.differences %}<td class="num">{% if d is none %}-{% else %}{{ '%+.4f' % d.mean }}
[{{ '%+.4f' % d.low }}, {{ '%+.4f' % d.high }}] <span class="{{ {'better': 'yes', 'worse': 'error'}.get(d.verdict, 'note') }}">{{ d.verdict }}</span>{% endif %}</td>{% endfor %}</tr>{% endif %}
{% endfor %}</tbody></table>
{% endif %}

<h2>Checkpoints</h2>
{% if checkpoints %}<table><thead><tr><th>checkpoint</th><th>step</th><th>update</th><th>best evaluation</th><th>written</th></tr></thead><tbody>
{% for c in checkpoints %}<tr><td><code>{{ c.path }}</code></td><td class="num">{{ c.step }}</td><td class="num">{{ '-' if c['update'] is none else c['update'] }}</td>
<td class="num">{{ '-' if c.best_eval is none else '%.4g' % c.best_eval }}</td><td>{{ c.written }}</td></tr>{% endfor %}
</tbody></table>{% else %}<p>none found.</p>{% endif %}

<script>{{ plotly_js | safe }}</script>
<script type="application/json" id="figures">{{ (curves + ([timeline] if timeline else [])) | tojson }}</script>
<script>{{ page_js | safe }}</script>
</body>
</html>
"""

PAGE_JS = r"""
"use strict";
for (const fig of JSON.parse(document.getElementById("figures").textContent)) {
  Plotly.newPlot(fig.id, fig.data, fig.layout, {displaylogo: false, responsive: true});
}
const table = document.getElementById("rollouts");
if (table) {
  const rows = Array.from(table.tBodies[0].rows), perPage = 50;
  const field = (id) => document.getElementById(id);
  let matching = rows, page = 0;
  const bound = (id, otherwise) => { const v = parseFloat(field(id).value); return Number.isNaN(v) ? otherwise : v; };
  const show = () => {
    const pages = Math.max(1, Math.ceil(matching.length / perPage));
    page = Math.min(Math.max(page, 0), pages - 1);
    const visible = new Set(matching.slice(page * perPage, (page + 1) * perPage));
    for (const row of rows) row.hidden = !visible.has(row);
    field("f-status").textContent = matching.length + " matching, page " + (page + 1) + " of " + pages;
  };
  const filter = () => {
    const update = field("f-update").value, trained = field("f-trained").value;
    const low = bound("f-min", -Infinity), high = bound("f-max", Infinity), anyReward = low === -Infinity && high === Infinity;
    matching = rows.filter((row) => {
      const d = row.dataset, reward = d.reward === "" ? NaN : Number(d.reward);
      return (update === "" || d.update === update) && (trained === "" || d.trained === trained)
        && (anyReward || (reward >= low && reward <= high));
    });
    page = 0;
    show();
  };
  for (const id of ["f-update", "f-min", "f-max", "f-trained"]) field(id).addEventListener("input", filter);
  field("f-prev").addEventListener("click", () => { page -= 1; show(); });
  field("f-next").addEventListener("click", () => { page += 1; show(); });
  filter();
}
"""


@functools.lru_cache(maxsize=1)
def _template() -> jinja2.Template:
    return jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined).from_string(PAGE)


@functools.lru_cache(maxsize=1)
def _plotly_js() -> str:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def render(**context) -> str:
    return _template().render(**context, plotly_js=_plotly_js(), page_js=PAGE_JS)
