//! The font the charts' text is drawn in: `SHARDNET_PLOT_FONT`, else the
//! first of a few common system fonts, registered once.

use super::*;

/// The environment variable naming the TrueType font charts are drawn with.
pub const FONT_ENV: &str = "SHARDNET_PLOT_FONT";

/// Where DejaVu Sans is looked for when [`FONT_ENV`] is unset (Debian and
/// Ubuntu, Fedora, Arch).
pub(super) const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

/// Register the font plotters draws `"sans-serif"` text with (its
/// `ab_glyph` backend reads no system font on its own): the file named by
/// `$SHARDNET_PLOT_FONT`, else DejaVu Sans where the distribution puts it.
/// The first call reads the font; later calls return its outcome.
pub fn register_font() -> Result<()> {
    static FONT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    FONT.get_or_init(load_font).clone().map_err(Error::Usage)
}

pub(super) fn load_font() -> std::result::Result<(), String> {
    let path = match std::env::var_os(FONT_ENV) {
        Some(p) => PathBuf::from(p),
        None => FONTS
            .iter()
            .map(PathBuf::from)
            .find(|p| p.is_file())
            .ok_or_else(|| {
                format!(
                    "no font to draw the charts' text with: none of {} exists; install \
                     DejaVu Sans (Debian: fonts-dejavu-core) or set {FONT_ENV} to a .ttf file",
                    FONTS.join(", ")
                )
            })?,
    };
    let bytes = fs::read(&path).map_err(|e| {
        format!(
            "font {}: {e} (set {FONT_ENV} to a .ttf file)",
            path.display()
        )
    })?;
    // plotters keeps the font for the life of the process.
    plotters::style::register_font(
        "sans-serif",
        FontStyle::Normal,
        Box::leak(bytes.into_boxed_slice()),
    )
    .map_err(|_| {
        format!(
            "font {}: not a TrueType font (set {FONT_ENV} to a .ttf file)",
            path.display()
        )
    })
}
