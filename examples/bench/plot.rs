//! `--plot`: bus bandwidth against size as SVG, drawn with plotters.

use plotters::element::DashedPathElement;
use plotters::prelude::*;

use crate::report::{g, human_bytes, Report};
use crate::BenchResult;

/// Line colours, one per series in turn (matplotlib's first eight).
const COLORS: [RGBColor; 8] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x17, 0xbe, 0xcf),
];

/// One line of the plot: an API and placement (and type and reduction where they vary).
struct Series {
    label: String,
    in_place: bool,
    /// (size in bytes, busbw in GB/s), in the order measured.
    points: Vec<(f64, f64)>,
}

/// Bus bandwidth against size on a log2 axis, one line per API, placement, type and
/// reduction; in-place lines are dashed.
pub fn svg(report: &Report, title: &str) -> BenchResult<String> {
    let several_types = report.rows.iter().any(|r| r.dtype != report.rows[0].dtype);
    let several_ops = report.rows.iter().any(|r| r.redop != report.rows[0].redop);
    let mut series: Vec<Series> = Vec::new();
    for (row, in_place, m) in report.all() {
        if row.size == 0 {
            continue;
        }
        let placement = if in_place { "in-place" } else { "out-of-place" };
        let mut label = format!("{} {placement}", m.api.name());
        if several_types {
            label = format!("{label} {}", row.dtype);
        }
        if several_ops {
            label = format!("{label} {}", row.redop);
        }
        let point = (row.size as f64, m.busbw);
        match series.iter_mut().find(|s| s.label == label) {
            Some(s) => s.points.push(point),
            None => series.push(Series {
                label,
                in_place,
                points: vec![point],
            }),
        }
    }
    draw(title, &series)
}

fn draw(title: &str, series: &[Series]) -> BenchResult<String> {
    let points = || series.iter().flat_map(|s| s.points.iter().copied());
    let (mut x0, mut x1) = points().fold((f64::MAX, f64::MIN), |(lo, hi), (x, _)| {
        (lo.min(x), hi.max(x))
    });
    if x0 > x1 {
        (x0, x1) = (1.0, 1.0);
    }
    // Less than two powers of two apart (one size, say): widen by one each way, so that the
    // axis has a few power-of-two ticks and the points stand inside it.
    if x1 < x0 * 4.0 {
        (x0, x1) = (x0 / 2.0, x1 * 2.0);
    }
    let y1 = points()
        .map(|(_, y)| y)
        .filter(|y| y.is_finite())
        .fold(1.0, f64::max)
        * 1.05;

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 520)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d((x0..x1).log_scale().base(2.0), 0.0..y1)?;
        chart
            .configure_mesh()
            .light_line_style(TRANSPARENT)
            .label_style(("sans-serif", 14))
            .x_desc("size")
            .y_desc("busbw (GB/s)")
            .x_label_formatter(&|&x| human_bytes(x))
            .y_label_formatter(&|&y| g(y))
            .draw()?;
        for (i, s) in series.iter().enumerate() {
            let style = COLORS[i % COLORS.len()].stroke_width(2);
            let line = s.points.iter().copied().filter(|(_, y)| y.is_finite());
            let legend = |(x, y): (i32, i32)| [(x, y), (x + 24, y)];
            if s.in_place {
                chart
                    .draw_series(DashedLineSeries::new(line.clone(), 6, 4, style))?
                    .label(&s.label)
                    .legend(move |p| DashedPathElement::new(legend(p), 6, 4, style));
            } else {
                chart
                    .draw_series(LineSeries::new(line.clone(), style))?
                    .label(&s.label)
                    .legend(move |p| PathElement::new(legend(p), style));
            }
            chart.draw_series(line.map(|p| Circle::new(p, 3, style.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .draw()?;
        root.present()?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::{Apis, Mode};
    use crate::report::tests::sample;

    #[test]
    fn one_labelled_line_per_api_and_placement() {
        let report = sample(Apis::Compare, Mode::Host, false);
        let svg = svg(&report, "all_reduce <8 ranks> & more").unwrap_or_default();
        assert!(svg.starts_with("<svg"), "{svg}");
        assert!(
            svg.contains("all_reduce &lt;8 ranks&gt; &amp; more"),
            "{svg}"
        );
        for label in [
            "safe out-of-place",
            "raw out-of-place",
            "safe in-place",
            "raw in-place",
        ] {
            assert!(svg.contains(label), "no {label:?} in\n{svg}");
        }
        // Powers of two on the size axis, named as sizes.
        for tick in ["8B", "2MiB", "1GiB"] {
            assert!(
                svg.contains(&format!(">\n{tick}\n<")),
                "no tick {tick} in\n{svg}"
            );
        }
    }
}
