"""The committed models' exporters (objects, faces, with tfjs_graph's conversion) and their accuracy check."""
