# The collector and the dashboard (no torch): one image, two commands in docker-compose.yml.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY agent agent
COPY server server
COPY dashboard dashboard
COPY alembic alembic
RUN pip install --no-cache-dir ".[server,postgres]" && (ampwatch fetch-plotly || true)
EXPOSE 8765 8050
CMD ["ampwatch", "serve", "--host", "0.0.0.0"]
