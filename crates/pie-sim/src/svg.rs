//! A small SVG chart writer, enough for `pie-sim compare --plots`: line charts
//! (one polyline per series) and bar charts (one bar per series), with axes,
//! "nice" ticks, a title and a legend. Each series is one `<g class="series">`
//! element named by `data-label`; text is XML-escaped.

use std::fmt::Write;

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 420.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 230.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
const PALETTE: &[&str] = &[
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

/// Titles of a chart.
pub struct Chart<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
}

/// A named line of (x, y) points.
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// Maps data to the plot area.
struct Frame {
    x_max: f64,
    y_max: f64,
}

impl Frame {
    fn x(&self, v: f64) -> f64 {
        LEFT + (WIDTH - LEFT - RIGHT) * (v / self.x_max)
    }

    fn y(&self, v: f64) -> f64 {
        HEIGHT - BOTTOM - (HEIGHT - TOP - BOTTOM) * (v / self.y_max)
    }
}

/// XML-escaped text.
pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Ticks at 1, 2 or 5 times a power of ten, about five of them, from 0 past
/// `max`; returns the ticks (the last is the axis end).
fn ticks(max: f64) -> Vec<f64> {
    let max = if max.is_finite() && max > 0.0 {
        max
    } else {
        1.0
    };
    let raw = max / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let n = (max / step).ceil() as usize;
    (0..=n).map(|i| i as f64 * step).collect()
}

fn label(v: f64) -> String {
    if v != 0.0 && (v.abs() >= 1e5 || v.abs() < 1e-2) {
        format!("{v:.0e}")
    } else if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

fn bar_value(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

fn open(out: &mut String, chart: &Chart) {
    let _ = write!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12"><rect width="{WIDTH}" height="{HEIGHT}" fill="white"/><text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
        (WIDTH - RIGHT + LEFT) / 2.0,
        escape(chart.title)
    );
}

fn axes(out: &mut String, chart: &Chart, frame: &Frame, x_ticks: Option<&[f64]>, y: &[f64]) {
    let (x0, x1, y0) = (LEFT, WIDTH - RIGHT, HEIGHT - BOTTOM);
    let _ = write!(
        out,
        r#"<g class="axes" stroke="black"><line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}"/><line x1="{x0}" y1="{TOP}" x2="{x0}" y2="{y0}"/></g>"#
    );
    for &t in y {
        let py = frame.y(t);
        let _ = write!(
            out,
            r##"<line x1="{x0}" y1="{py:.1}" x2="{x1}" y2="{py:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            x0 - 6.0,
            py + 4.0,
            label(t)
        );
    }
    for &t in x_ticks.unwrap_or(&[]) {
        let px = frame.x(t);
        let _ = write!(
            out,
            r#"<text x="{px:.1}" y="{}" text-anchor="middle">{}</text>"#,
            y0 + 16.0,
            label(t)
        );
    }
    let _ = write!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text><text transform="translate(16 {}) rotate(-90)" text-anchor="middle">{}</text>"#,
        (x0 + x1) / 2.0,
        HEIGHT - 12.0,
        escape(chart.x_label),
        (TOP + y0) / 2.0,
        escape(chart.y_label)
    );
}

fn legend_entry(out: &mut String, i: usize, text: &str) {
    let (x, y) = (WIDTH - RIGHT + 16.0, TOP + 18.0 * i as f64);
    let _ = write!(
        out,
        r#"<rect x="{x}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{}</text>"#,
        y,
        PALETTE[i % PALETTE.len()],
        x + 18.0,
        y + 10.0,
        escape(text)
    );
}

/// One polyline per series.
pub fn line_chart(chart: &Chart, series: &[Series]) -> String {
    let all = || series.iter().flat_map(|s| s.points.iter());
    let x_ticks = ticks(all().map(|p| p.0).fold(0.0, f64::max));
    let y_ticks = ticks(all().map(|p| p.1).fold(0.0, f64::max));
    let frame = Frame {
        x_max: *x_ticks.last().unwrap_or(&1.0),
        y_max: *y_ticks.last().unwrap_or(&1.0),
    };
    let mut out = String::new();
    open(&mut out, chart);
    axes(&mut out, chart, &frame, Some(&x_ticks), &y_ticks);
    for (i, s) in series.iter().enumerate() {
        let points: Vec<String> = s
            .points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", frame.x(x), frame.y(y)))
            .collect();
        let _ = write!(
            out,
            r#"<g class="series" data-label="{}"><polyline fill="none" stroke="{}" stroke-width="2" points="{}"/></g>"#,
            escape(&s.label),
            PALETTE[i % PALETTE.len()],
            points.join(" ")
        );
        legend_entry(&mut out, i, &s.label);
    }
    out.push_str("</svg>\n");
    out
}

/// One bar per (label, value), the value written above it.
pub fn bar_chart(chart: &Chart, bars: &[(String, f64)]) -> String {
    let y_ticks = ticks(bars.iter().map(|b| b.1).fold(0.0, f64::max));
    let frame = Frame {
        x_max: bars.len().max(1) as f64,
        y_max: *y_ticks.last().unwrap_or(&1.0),
    };
    let mut out = String::new();
    open(&mut out, chart);
    axes(&mut out, chart, &frame, None, &y_ticks);
    let slot = frame.x(1.0) - frame.x(0.0);
    for (i, (name, v)) in bars.iter().enumerate() {
        let (x, y) = (frame.x(i as f64) + slot * 0.15, frame.y(*v));
        let _ = write!(
            out,
            r#"<g class="series" data-label="{}"><rect x="{x:.1}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="{}"/><text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text></g>"#,
            escape(name),
            slot * 0.7,
            frame.y(0.0) - y,
            PALETTE[i % PALETTE.len()],
            x + slot * 0.35,
            y - 4.0,
            bar_value(*v)
        );
        legend_entry(&mut out, i, name);
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_maximum() {
        assert_eq!(ticks(9.3), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        let unit = ticks(1.0);
        assert_eq!((unit.len(), unit[1], unit[5]), (6, 0.2, 1.0));
        assert_eq!(ticks(0.0).last(), Some(&1.0));
        assert_eq!(escape("a<b & \"c\""), "a&lt;b &amp; &quot;c&quot;");
    }
}
