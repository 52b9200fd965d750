"""The dashboard's static files (HTML, script, style): no build step, no CDN, served by
``services.live``."""
