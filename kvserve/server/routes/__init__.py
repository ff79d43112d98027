"""The app's routes, one APIRouter per group: the OpenAI API (``openai``) and operations (``admin``)."""
