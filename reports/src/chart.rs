//! Line charts drawn with plotters into a PNG and an SVG of the same figure.
//!
//! Text is laid out with ab_glyph from the DejaVu Sans file shipped in `assets/` (Bitstream
//! Vera license, beside it), so rendering needs no system fonts or fontconfig.

use crate::error::ReportError;
use infer_core::FileError;
use std::path::{Path, PathBuf};
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;

/// Pixel size of a one-panel figure; a figure of n panels is n times as wide.
pub const PANEL_SIZE: (u32, u32) = (960, 540);

/// Most points drawn per series: more adds file size, not information, at this resolution.
const MAX_POINTS: usize = 2000;

#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    /// A shaded band under the line, `(x, lo, hi)`: a prediction's 90% interval (empty:
    /// none).
    pub band: Vec<(f64, f64, f64)>,
}

/// One set of axes.
#[derive(Debug, Clone, PartialEq)]
pub struct Panel {
    pub title: String,
    /// Axis descriptions, with units.
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    /// Mark each point (sweeps with few points); plain lines for time series and CDFs.
    pub markers: bool,
}

/// One or more panels side by side, written as `<name>.png` and `<name>.svg`.
#[derive(Debug, Clone, PartialEq)]
pub struct Figure {
    pub name: String,
    pub title: String,
    pub panels: Vec<Panel>,
}

impl Figure {
    pub fn single(name: &str, panel: Panel) -> Figure {
        Figure {
            name: name.into(),
            title: panel.title.clone(),
            panels: vec![panel],
        }
    }

    pub fn size(&self) -> (u32, u32) {
        (PANEL_SIZE.0 * self.panels.len() as u32, PANEL_SIZE.1)
    }

    /// Whether any panel has a point to draw.
    pub fn has_data(&self) -> bool {
        self.panels
            .iter()
            .any(|p| p.series.iter().any(|s| !s.points.is_empty()))
    }

    /// Writes the PNG and the SVG into `dir`; returns their paths.
    pub fn render(&self, dir: &Path) -> Result<[PathBuf; 2], ReportError> {
        register_font();
        std::fs::create_dir_all(dir).map_err(FileError::at(dir, "create"))?;
        let png = dir.join(format!("{}.png", self.name));
        let svg = dir.join(format!("{}.svg", self.name));
        let err = |p: &Path, reason: String| ReportError::Chart {
            path: p.to_path_buf(),
            reason,
        };
        {
            let root = BitMapBackend::new(&png, self.size()).into_drawing_area();
            self.draw(&root).map_err(|e| err(&png, e))?;
            root.present().map_err(|e| err(&png, e.to_string()))?;
        }
        {
            let root = SVGBackend::new(&svg, self.size()).into_drawing_area();
            self.draw(&root).map_err(|e| err(&svg, e))?;
            root.present().map_err(|e| err(&svg, e.to_string()))?;
        }
        Ok([png, svg])
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<(), String> {
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let body = match self.panels.len() {
            1 => root.clone(),
            _ => root
                .titled(&self.title, ("sans-serif", 26))
                .map_err(|e| e.to_string())?,
        };
        let areas = body.split_evenly((1, self.panels.len()));
        for (panel, area) in self.panels.iter().zip(&areas) {
            draw_panel(panel, area).map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

/// Tableau 10: distinct to most readers, colour-blind included.
const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

fn draw_panel<DB: DrawingBackend>(
    panel: &Panel,
    area: &DrawingArea<DB, Shift>,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let (x, y) = ranges(panel);
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(x, y)?;
    chart
        .configure_mesh()
        .x_desc(&panel.x_label)
        .y_desc(&panel.y_label)
        .x_label_formatter(&tick)
        .y_label_formatter(&tick)
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 16))
        .light_line_style(WHITE.mix(0.0))
        .draw()?;
    for (i, s) in panel.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        if !s.band.is_empty() {
            // The upper edge left to right, then the lower one back.
            let edge: Vec<(f64, f64)> = s
                .band
                .iter()
                .map(|&(x, _, hi)| (x, hi))
                .chain(s.band.iter().rev().map(|&(x, lo, _)| (x, lo)))
                .collect();
            chart.draw_series(std::iter::once(Polygon::new(
                edge,
                color.mix(0.18).filled(),
            )))?;
        }
        let points = thin(&s.points);
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(&s.name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
        if panel.markers {
            chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
        }
    }
    if !panel.series.is_empty() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font(("sans-serif", 14))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .draw()?;
    }
    Ok(())
}

/// Axis ranges covering every point; y starts at zero (all our figures are non-negative
/// and a floating origin exaggerates small differences).
fn ranges(panel: &Panel) -> (std::ops::Range<f64>, std::ops::Range<f64>) {
    let bands = panel
        .series
        .iter()
        .flat_map(|s| &s.band)
        .map(|&(x, _, hi)| (x, hi));
    let pts = panel
        .series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .chain(bands);
    let (mut x0, mut x1, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, 0.0f64);
    for (x, y) in pts.filter(|(x, y)| x.is_finite() && y.is_finite()) {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y1 = y1.max(y);
    }
    if !x0.is_finite() {
        (x0, x1) = (0.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= 0.0 {
        y1 = 1.0;
    }
    (x0..x1, 0.0..y1 * 1.05)
}

/// Tick labels without plotters' trailing ".0" ("200" rather than "200.0").
fn tick(v: &f64) -> String {
    let s = match v.abs() {
        a if a >= 100.0 => format!("{v:.0}"),
        _ => format!("{v:.3}"),
    };
    match s.contains('.') {
        true => s.trim_end_matches('0').trim_end_matches('.').to_string(),
        false => s,
    }
}

/// Every k-th point (and the last) when a series has more than `MAX_POINTS`.
fn thin(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let finite: Vec<(f64, f64)> = points
        .iter()
        .copied()
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    if finite.len() <= MAX_POINTS {
        return finite;
    }
    let step = finite.len().div_ceil(MAX_POINTS);
    let mut out: Vec<(f64, f64)> = finite.iter().copied().step_by(step).collect();
    let last = finite[finite.len() - 1];
    if out.last() != Some(&last) {
        out.push(last);
    }
    out
}

fn register_font() {
    static FONT: Once = Once::new();
    FONT.call_once(|| {
        let bytes: &'static [u8] = include_bytes!("../assets/DejaVuSans.ttf");
        // Every family name plotters may ask for maps to the one font we ship.
        for family in ["sans-serif", "serif", "monospace"] {
            plotters::style::register_font(family, FontStyle::Normal, bytes)
                .map_err(|_| ())
                .expect("the shipped font parses");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thinning_keeps_the_ends_and_bounds_the_count() {
        let pts: Vec<(f64, f64)> = (0..10_001).map(|i| (i as f64, 1.0)).collect();
        let t = thin(&pts);
        assert!(t.len() <= MAX_POINTS + 1);
        assert_eq!(t.first(), Some(&(0.0, 1.0)));
        assert_eq!(t.last(), Some(&(10_000.0, 1.0)));
    }

    #[test]
    fn ticks_drop_needless_decimals() {
        assert_eq!(tick(&200.0), "200");
        assert_eq!(tick(&1400.0), "1400");
        assert_eq!(tick(&0.5), "0.5");
        assert_eq!(tick(&0.035), "0.035");
        assert_eq!(tick(&0.0), "0");
    }

    #[test]
    fn ranges_start_at_zero_and_cover_the_points_and_bands() {
        let panel = Panel {
            title: String::new(),
            x_label: String::new(),
            y_label: String::new(),
            series: vec![Series {
                name: "a".into(),
                points: vec![(2.0, 5.0), (4.0, 10.0)],
                band: vec![(2.0, 4.0, 6.0), (4.0, 8.0, 30.0)],
            }],
            markers: false,
        };
        let (x, y) = ranges(&panel);
        assert_eq!((x.start, x.end), (2.0, 4.0));
        assert_eq!(y.start, 0.0);
        assert!(y.end >= 30.0, "the band's top is in view: {y:?}");
    }
}
