"""The serving tier's link between front processes and engine cores (docs/ARCHITECTURE.md, "Serving tier")."""
