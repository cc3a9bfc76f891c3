//! The experiment's plot: personalization score against updates, one line per method (with a
//! band of mean ± standard deviation when the results span several seeds), as a PNG drawn with
//! `plotters`' bitmap backend. No font is needed: the few labels (tick values, the legend) are
//! drawn with a built-in 5×7 pixel font, so nothing is loaded from the system.

use std::path::Path;

use plotters::prelude::*;
use thiserror::Error;

use super::experiment::Results;

/// Why the plot could not be drawn.
#[derive(Debug, Error)]
#[error("plotting {path}: {message}")]
pub struct PlotError {
    /// The file.
    pub path: String,
    /// What went wrong.
    pub message: String,
}

/// 5×7 glyphs, one `u8` per row (bit 4 = leftmost pixel).
fn glyph(c: char) -> Option<[u8; 7]> {
    Some(match c {
        '0' => [14, 17, 19, 21, 25, 17, 14],
        '1' => [4, 12, 4, 4, 4, 4, 14],
        '2' => [14, 17, 1, 2, 4, 8, 31],
        '3' => [31, 2, 4, 2, 1, 17, 14],
        '4' => [2, 6, 10, 18, 31, 2, 2],
        '5' => [31, 16, 30, 1, 1, 17, 14],
        '6' => [6, 8, 16, 30, 17, 17, 14],
        '7' => [31, 1, 2, 4, 8, 8, 8],
        '8' => [14, 17, 17, 14, 17, 17, 14],
        '9' => [14, 17, 17, 15, 1, 2, 12],
        '.' => [0, 0, 0, 0, 0, 12, 12],
        'a' => [0, 0, 14, 1, 15, 17, 15],
        'b' => [16, 16, 22, 25, 17, 17, 30],
        'c' => [0, 0, 14, 16, 16, 17, 14],
        'd' => [1, 1, 13, 19, 17, 17, 15],
        'e' => [0, 0, 14, 17, 31, 16, 14],
        'g' => [0, 0, 15, 17, 15, 1, 14],
        'h' => [16, 16, 22, 25, 17, 17, 17],
        'l' => [12, 4, 4, 4, 4, 4, 14],
        '_' => [0, 0, 0, 0, 0, 0, 31],
        'i' => [4, 0, 12, 4, 4, 4, 14],
        'm' => [0, 0, 26, 21, 21, 17, 17],
        'n' => [0, 0, 22, 25, 17, 17, 17],
        'o' => [0, 0, 14, 17, 17, 17, 14],
        'p' => [0, 0, 30, 17, 30, 16, 16],
        'r' => [0, 0, 22, 25, 16, 16, 16],
        's' => [0, 0, 14, 16, 14, 1, 30],
        't' => [8, 8, 28, 8, 8, 9, 6],
        'u' => [0, 0, 17, 17, 17, 19, 13],
        'y' => [0, 0, 17, 17, 15, 1, 14],
        ' ' => [0; 7],
        _ => return None,
    })
}

/// Draws `text` with its top-left corner at `(x, y)`, each font pixel `scale` pixels wide.
fn draw_text<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    text: &str,
    (x, y): (i32, i32),
    scale: i32,
    color: &RGBColor,
) -> Result<(), String> {
    let mut cx = x;
    for ch in text.chars() {
        let rows = glyph(ch.to_ascii_lowercase()).unwrap_or([31, 17, 17, 17, 17, 17, 31]);
        for (r, bits) in rows.iter().enumerate() {
            for col in 0..5 {
                if bits & (1 << (4 - col)) != 0 {
                    let px = cx + col * scale;
                    let py = y + r as i32 * scale;
                    area.draw(&Rectangle::new(
                        [(px, py), (px + scale - 1, py + scale - 1)],
                        color.filled(),
                    ))
                    .map_err(|e| e.to_string())?;
                }
            }
        }
        cx += 6 * scale;
    }
    Ok(())
}

/// The color of a method's line.
fn color(method: &str) -> RGBColor {
    match method {
        "binary" => RGBColor(220, 120, 30),
        "opd" => RGBColor(40, 110, 200),
        "combined" | "integrated" => RGBColor(30, 160, 70),
        "outcome_only" => RGBColor(220, 120, 30),
        _ => RGBColor(120, 120, 120),
    }
}

/// Writes the plot of `results` to `path` (PNG, 640×420).
pub fn plot_scores(results: &Results, path: &Path) -> Result<(), PlotError> {
    draw(results, path).map_err(|message| PlotError {
        path: path.display().to_string(),
        message,
    })
}

fn draw(results: &Results, path: &Path) -> Result<(), String> {
    let (w, h) = (640i32, 420i32);
    let root = BitMapBackend::new(path, (w as u32, h as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let max_x = results.updates.iter().copied().max().unwrap_or(1).max(1) as f64;
    // Plot area in pixels.
    // The legend's width follows the longest line name (12 pixels a character).
    let longest = results.scores.keys().map(|k| k.len()).max().unwrap_or(0) as i32;
    let (left, right, top, bottom) = (60i32, w - (60 + 12 * longest).max(150), 40i32, h - 50);
    let px = |x: f64| left + ((x / max_x) * (right - left) as f64).round() as i32;
    let py = |y: f64| bottom - (y.clamp(0.0, 1.0) * (bottom - top) as f64).round() as i32;
    let grey = RGBColor(210, 210, 210);
    let black = RGBColor(0, 0, 0);
    for i in 0..=5 {
        let y = i as f64 / 5.0;
        root.draw(&PathElement::new(vec![(left, py(y)), (right, py(y))], grey))
            .map_err(|e| e.to_string())?;
        draw_text(&root, &format!("{y:.1}"), (left - 40, py(y) - 7), 2, &black)?;
    }
    for &u in &results.updates {
        root.draw(&PathElement::new(
            vec![(px(u as f64), top), (px(u as f64), bottom)],
            grey,
        ))
        .map_err(|e| e.to_string())?;
        draw_text(
            &root,
            &u.to_string(),
            (px(u as f64) - 5, bottom + 8),
            2,
            &black,
        )?;
    }
    draw_text(
        &root,
        "updates",
        ((left + right) / 2 - 40, bottom + 30),
        2,
        &black,
    )?;
    root.draw(&PathElement::new(
        vec![(left, top), (left, bottom), (right, bottom)],
        black.stroke_width(2),
    ))
    .map_err(|e| e.to_string())?;
    // Bands first, so every line is drawn over them.
    for (method, scores) in &results.scores {
        let Some(std) = results.std.as_ref().and_then(|s| s.get(method)) else {
            continue;
        };
        let upper = results
            .updates
            .iter()
            .zip(scores.iter().zip(std))
            .map(|(&u, (&m, &sd))| (px(u as f64), py(m + sd)));
        let lower = results
            .updates
            .iter()
            .zip(scores.iter().zip(std))
            .rev()
            .map(|(&u, (&m, &sd))| (px(u as f64), py(m - sd)));
        let outline: Vec<(i32, i32)> = upper.chain(lower).collect();
        root.draw(&Polygon::new(outline, color(method).mix(0.2).filled()))
            .map_err(|e| e.to_string())?;
    }
    for (k, (method, scores)) in results.scores.iter().enumerate() {
        let c = color(method);
        let pts: Vec<(i32, i32)> = results
            .updates
            .iter()
            .zip(scores)
            .map(|(&u, &s)| (px(u as f64), py(s)))
            .collect();
        root.draw(&PathElement::new(pts.clone(), c.stroke_width(3)))
            .map_err(|e| e.to_string())?;
        for p in pts {
            root.draw(&Circle::new(p, 5, c.filled()))
                .map_err(|e| e.to_string())?;
        }
        let ly = top + 28 * k as i32;
        root.draw(&PathElement::new(
            vec![(right + 15, ly + 7), (right + 40, ly + 7)],
            c.stroke_width(3),
        ))
        .map_err(|e| e.to_string())?;
        draw_text(&root, method, (right + 48, ly), 2, &c)?;
    }
    draw_text(&root, "score", (left - 40, 8), 2, &black)?;
    root.present().map_err(|e| e.to_string())?;
    Ok(())
}
