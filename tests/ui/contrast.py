"""Text contrast as a reader sees it in the page, for the browser tests (WCAG 2 ratio)."""

from __future__ import annotations

__all__ = ["text_contrast_failures"]


def text_contrast_failures(page, selector: str, minimum: float = 4.5) -> list[str]:
    """Text under ``selector`` (HTML and SVG) whose WCAG contrast is below ``minimum``.

    Each text's colour (SVG: its fill) is blended over the first opaque background
    among its ancestors (alpha included: JupyterLab's muted text is translucent), as
    the eye sees it. Returns "text: ratio (colour on background)" for each failure.
    """
    return page.evaluate(
        """([selector, minimum]) => {
  const canvas = document.createElement('canvas').getContext('2d');
  // Any CSS colour (rgb(), color(srgb ...), color-mix results) -> [r, g, b, a] in 0..255.
  function rgba(css) {
    canvas.clearRect(0, 0, 1, 1);
    canvas.fillStyle = '#000';
    canvas.fillStyle = css;
    canvas.fillRect(0, 0, 1, 1);
    const d = canvas.getImageData(0, 0, 1, 1).data;
    return [d[0], d[1], d[2], d[3] / 255];
  }
  function over(top, under) {
    const a = top[3];
    return [0, 1, 2].map(i => a * top[i] + (1 - a) * under[i]).concat(1);
  }
  function background(el) {
    const layers = [];
    for (let node = el; node && node.nodeType === 1; node = node.parentElement) {
      if (node instanceof SVGElement && !(node instanceof SVGSVGElement)) continue;
      const c = rgba(getComputedStyle(node).backgroundColor);
      if (c[3] > 0) layers.push(c);
      if (c[3] >= 1) break;
    }
    let colour = [255, 255, 255, 1];
    for (const layer of layers.reverse()) colour = over(layer, colour);
    return colour;
  }
  function luminance(c) {
    const lin = c.slice(0, 3).map(v => {
      v /= 255;
      return v <= 0.04045 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4);
    });
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2];
  }
  const failures = [];
  const seen = new Set();
  for (const root of document.querySelectorAll(selector)) {
    const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    for (let text = walker.nextNode(); text; text = walker.nextNode()) {
      const el = text.parentElement;
      if (!el || seen.has(el) || !text.textContent.trim()) continue;
      seen.add(el);
      const rect = el.getBoundingClientRect();
      const style = getComputedStyle(el);
      if (!rect.width || !rect.height || style.visibility === 'hidden' || style.opacity === '0') continue;
      const bg = background(el);
      const fg = over(rgba(el instanceof SVGElement ? style.fill : style.color), bg);
      const [hi, lo] = [luminance(fg), luminance(bg)].sort((a, b) => b - a);
      const ratio = (hi + 0.05) / (lo + 0.05);
      if (ratio < minimum) {
        failures.push(`${text.textContent.trim().slice(0, 40)}: ${ratio.toFixed(2)} (${fg} on ${bg})`);
      }
    }
  }
  return failures;
}""",
        [selector, minimum],
    )
