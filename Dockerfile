# The collector and the dashboard (no torch): one image, two commands in docker-compose.yml.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY agent agent
COPY server server
COPY dashboard dashboard
COPY alembic alembic
# No torch: every collector command imports only what it needs (tests/deploy/test_deploy_image.py
# installs this set into a fresh venv and runs the compose services' commands). fetch-plotly
# --optional: a build without npm's registry keeps the full plotly.js; any other failure
# (`|| true` hid a collector that could not start) fails the build.
RUN pip install --no-cache-dir ".[server,postgres]" \
    && ampwatch --help > /dev/null \
    && ampwatch fetch-plotly --optional
EXPOSE 8765 8050
CMD ["ampwatch", "serve", "--host", "0.0.0.0"]
