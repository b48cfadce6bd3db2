"""No Transformers glue for the toy kernel."""
